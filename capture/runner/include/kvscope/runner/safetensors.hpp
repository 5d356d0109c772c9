// A reader for the safetensors format: 8-byte little-endian header length, a JSON header mapping tensor
// names to {dtype, shape, data_offsets}, then the raw data. F32, F16 and BF16 are converted to float32.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace kvscope::runner {

enum class StDType { kF32, kF16, kBF16, kI32, kI64, kU8 };

struct StTensorInfo {
  StDType dtype = StDType::kF32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // byte offsets into the data section
  std::int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Reads and checks the header; the file stays open and each tensor's bytes are read when it is
  // converted. Throws RunnerError(kModel) naming the file for a missing or truncated file, a bad header, an
  // unknown dtype or offsets outside the data section (and the conversions for a read error).
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::map<std::string, StTensorInfo>& tensors() const { return tensors_; }
  // The header's "__metadata__" (string -> string); empty when absent.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StTensorInfo& info(const std::string& name) const;  // throws naming the missing tensor
  // The tensor converted to float32 (F32/F16/BF16/I32/I64/U8), row-major.
  std::vector<float> to_f32(const std::string& name) const;
  // As to_f32, after checking the shape; the error names tensor, expected and actual shape.
  std::vector<float> to_f32(const std::string& name, const std::vector<std::int64_t>& expected_shape) const;
  // Integer tensors (I32/I64/U8) as int64.
  std::vector<std::int64_t> to_i64(const std::string& name) const;

 private:
  std::vector<std::uint8_t> bytes(const StTensorInfo& t) const;  // the tensor's raw bytes

  std::string path_;
  mutable std::ifstream in_;       // the open file (reads seek, so conversions are not thread-safe)
  std::uint64_t data_offset_ = 0;  // file offset of the data section
  std::map<std::string, StTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A model folder's weights as Hugging Face saves them: one `model.safetensors`, or shards listed by
// `model.safetensors.index.json` (its "weight_map": tensor name -> shard file in the same folder). Throws
// RunnerError(kModel) naming the file for a folder with neither, an index that is not JSON or has no
// weight_map, a shard name with a path separator, a shard that cannot be read, or a mapped tensor that is
// not in its shard.
class SafetensorsWeights {
 public:
  explicit SafetensorsWeights(const std::string& dir);

  // The file (`model.safetensors` or the index) the weights were found through.
  const std::string& source() const { return source_; }
  std::size_t num_files() const { return files_.size(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // As SafetensorsFile::to_f32 on the shard holding `name`; a name the folder lacks throws naming source().
  std::vector<float> to_f32(const std::string& name, const std::vector<std::int64_t>& expected_shape) const;

 private:
  std::string source_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t> where_;  // tensor name -> index into files_
};

std::string shape_string(const std::vector<std::int64_t>& shape);

}  // namespace kvscope::runner
