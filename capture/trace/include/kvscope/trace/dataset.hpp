// Datasets of traces (docs/datasets.md): a directory of trace files plus DIR/manifest.csv, one row per
// sample with its metadata (family, context length, images, reference answer, capture command). kvcap run
// --samples writes them, kvsim sweep --dataset reads them. The manifest is plain CSV (RFC 4180) so that
// pandas reads it with no options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/trace/error.hpp"

namespace kvscope::trace {

inline constexpr const char* kManifestName = "manifest.csv";
// Most samples (rows) a manifest may declare, and its largest size: a typo or a foreign file must not
// make a reader allocate gigabytes.
inline constexpr std::size_t kMaxDatasetSamples = 1000000;
inline constexpr std::uint64_t kMaxManifestBytes = 256ull << 20;

// The columns kvcap run --samples writes, in order (docs/datasets.md); `sample` and `trace` are the
// only ones a reader requires, others may be absent or empty (unknown).
const std::vector<std::string>& manifest_columns();

struct DatasetSample {
  std::string sample;  // sample id, unique in the dataset (e.g. s00042)
  std::string trace;   // the trace file as listed (relative to the dataset directory) or given
  std::string path;    // the file to open: the directory joined with `trace` (absolute paths unchanged)
  std::vector<std::string> values;  // every manifest column of the row, in Dataset::columns order
};

struct Dataset {
  std::string source;                // the directory, or the list / glob as given
  bool has_manifest = false;         // read from DIR/manifest.csv (else a list of trace files)
  std::vector<std::string> columns;  // manifest header (a list of traces gets `sample,trace`)
  std::vector<DatasetSample> samples;
  // The value of `column` for sample i, "" when the column is absent.
  std::string value(std::size_t i, const std::string& column) const;
};

// Reads DIR/manifest.csv. Throws TraceError (kIo: no manifest; kFormat: not a manifest, with the line)
// naming the manifest: a missing `sample` or `trace` column, a row with another number of fields than
// the header, an empty or duplicated sample id, an unterminated quote, more than kMaxDatasetSamples rows.
Dataset read_manifest(const std::string& dir);

// `spec` is a dataset directory (with manifest.csv), or a comma-separated list of trace files and glob
// patterns (`dir/*.h5`, each expanded in sorted order). A list gets the sample ids of the file names'
// stems (made unique with their position when two are equal). Throws TraceError naming the item.
Dataset open_dataset(const std::string& spec);

// Writes DIR/manifest.csv (to manifest.csv.partial, renamed when complete). `rows` has one entry per
// sample with columns.size() fields. Throws TraceError(kIo) naming the file, leaving no file.
void write_manifest(const std::string& dir, const std::vector<std::string>& columns,
                    const std::vector<std::vector<std::string>>& rows);

// RFC 4180 field: quoted when it holds a comma, a quote or a line break (or leading/trailing spaces).
std::string csv_field(const std::string& s);

}  // namespace kvscope::trace
