// safetensors reader: the header is parsed up front and every offset checked against the file size; a
// tensor's bytes are read when it is converted, so loading holds the converted weights plus one tensor.
#include "kvscope/runner/safetensors.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvscope/kernels/common.hpp"
#include "kvscope/runner/error.hpp"

namespace kvscope::runner {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw RunnerError(ErrorKind::kModel, path + ": " + msg);
}

std::size_t dtype_size(StDType t) {
  switch (t) {
    case StDType::kF32:
    case StDType::kI32:
      return 4;
    case StDType::kF16:
    case StDType::kBF16:
      return 2;
    case StDType::kI64:
      return 8;
    case StDType::kU8:
      return 1;
  }
  return 1;
}

bool parse_dtype(const std::string& s, StDType* out) {
  if (s == "F32")
    *out = StDType::kF32;
  else if (s == "F16")
    *out = StDType::kF16;
  else if (s == "BF16")
    *out = StDType::kBF16;
  else if (s == "I32")
    *out = StDType::kI32;
  else if (s == "I64")
    *out = StDType::kI64;
  else if (s == "U8")
    *out = StDType::kU8;
  else
    return false;
  return true;
}

}  // namespace

std::int64_t StTensorInfo::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail(path, "cannot open safetensors file");
  const std::streamoff file_size = in.tellg();
  in.seekg(0);
  if (file_size < 8) fail(path, "truncated: " + std::to_string(file_size) + " bytes, no header length");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > static_cast<std::uint64_t>(file_size) - 8) {
    fail(path, "truncated or bad header: header length " + std::to_string(header_len) + " exceeds the " +
                   std::to_string(file_size) + "-byte file");
  }
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!in) fail(path, "read error");
  const std::uint64_t data_size = static_cast<std::uint64_t>(file_size) - 8 - header_len;
  data_offset_ = 8 + header_len;
  in_ = std::move(in);

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("bad header (not JSON: ") + e.what() + ")");
  }
  if (!j.is_object()) fail(path, "bad header (not a JSON object)");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) fail(path, "bad header (__metadata__ is not an object)");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) fail(path, "bad header (__metadata__ values must be strings)");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& t = it.value();
    const std::string where = "tensor '" + it.key() + "'";
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets") ||
        !t["dtype"].is_string() || !t["shape"].is_array() || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      fail(path, "bad header entry for " + where);
    }
    StTensorInfo info;
    if (!parse_dtype(t["dtype"].get<std::string>(), &info.dtype)) {
      fail(path, where + " has unsupported dtype " + t["dtype"].dump() + " (supported: F32, F16, BF16)");
    }
    for (const auto& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<std::int64_t>() < 0) fail(path, where + " has a bad shape");
      info.shape.push_back(d.get<std::int64_t>());
    }
    const auto& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, where + " has bad data_offsets");
    info.begin = off[0].get<std::uint64_t>();
    info.end = off[1].get<std::uint64_t>();
    if (info.begin > info.end || info.end > data_size) {
      fail(path, where + " data [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
                     ") lies outside the " + std::to_string(data_size) +
                     "-byte data section (truncated file?)");
    }
    if (info.end - info.begin != static_cast<std::uint64_t>(info.numel()) * dtype_size(info.dtype)) {
      fail(path, where + " byte size does not match its shape " + shape_string(info.shape));
    }
    tensors_.emplace(it.key(), std::move(info));
  }
}

std::vector<std::uint8_t> SafetensorsFile::bytes(const StTensorInfo& t) const {
  std::vector<std::uint8_t> out(t.end - t.begin);
  in_.clear();
  in_.seekg(static_cast<std::streamoff>(data_offset_ + t.begin));
  if (!out.empty()) in_.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  if (!in_) fail(path_, "read error (file changed or truncated while loading?)");
  return out;
}

const StTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, "missing tensor '" + name + "'");
  return it->second;
}

std::vector<float> SafetensorsFile::to_f32(const std::string& name) const {
  const StTensorInfo& t = info(name);
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<float> out(n);
  if (t.dtype == StDType::kF32) {  // straight into the result
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(data_offset_ + t.begin));
    if (n) in_.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(4 * n));
    if (!in_) fail(path_, "read error (file changed or truncated while loading?)");
    return out;
  }
  const std::vector<std::uint8_t> raw = bytes(t);
  const std::uint8_t* p = raw.data();
  for (std::size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case StDType::kF32:
        std::memcpy(&out[i], p + 4 * i, 4);
        break;
      case StDType::kF16:
      case StDType::kBF16: {
        std::uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = t.dtype == StDType::kF16 ? kernels::half_to_float(h) : kernels::bf16_to_float(h);
        break;
      }
      case StDType::kI32: {
        std::int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = static_cast<float>(v);
        break;
      }
      case StDType::kI64: {
        std::int64_t v;
        std::memcpy(&v, p + 8 * i, 8);
        out[i] = static_cast<float>(v);
        break;
      }
      case StDType::kU8:
        out[i] = p[i];
        break;
    }
  }
  return out;
}

std::vector<float> SafetensorsFile::to_f32(const std::string& name,
                                           const std::vector<std::int64_t>& expected_shape) const {
  const StTensorInfo& t = info(name);
  if (t.shape != expected_shape) {
    fail(path_, "tensor '" + name + "' has shape " + shape_string(t.shape) + ", expected " +
                    shape_string(expected_shape));
  }
  return to_f32(name);
}

std::vector<std::int64_t> SafetensorsFile::to_i64(const std::string& name) const {
  const StTensorInfo& t = info(name);
  const std::size_t n = static_cast<std::size_t>(t.numel());
  std::vector<std::int64_t> out(n);
  const std::vector<std::uint8_t> raw = bytes(t);
  const std::uint8_t* p = raw.data();
  for (std::size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case StDType::kI32: {
        std::int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = v;
        break;
      }
      case StDType::kI64:
        std::memcpy(&out[i], p + 8 * i, 8);
        break;
      case StDType::kU8:
        out[i] = p[i];
        break;
      default:
        fail(path_, "tensor '" + name + "' is not an integer tensor");
    }
  }
  return out;
}

SafetensorsWeights::SafetensorsWeights(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single) || !fs::exists(index)) {
    source_ = single.string();
    files_.emplace_back(source_);  // throws naming the file when it is missing
    for (const auto& [name, info] : files_.back().tensors()) where_[name] = 0;
    return;
  }
  source_ = index.string();
  nlohmann::json j;
  {
    std::ifstream in(index);
    if (!in) fail(source_, "cannot open the shard index");
    j = nlohmann::json::parse(in, nullptr, false);
  }
  if (j.is_discarded() || !j.is_object()) fail(source_, "not a JSON object");
  if (!j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty()) {
    fail(source_, "no \"weight_map\" of tensor names to shard files");
  }
  std::map<std::string, std::size_t> shard_index;  // shard file name -> index into files_
  for (const auto& [name, shard] : j["weight_map"].items()) {
    if (!shard.is_string()) fail(source_, "weight_map['" + name + "'] is not a file name");
    const std::string file = shard.get<std::string>();
    if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos ||
        file == "." || file == "..") {
      fail(source_, "weight_map['" + name + "'] = '" + file + "' is not a file name in the model folder");
    }
    auto it = shard_index.find(file);
    if (it == shard_index.end()) {
      files_.emplace_back((fs::path(dir) / file).string());  // throws naming the shard
      it = shard_index.emplace(file, files_.size() - 1).first;
    }
    if (!files_[it->second].contains(name)) {
      fail(files_[it->second].path(), "has no tensor '" + name + "' (" + source_ + " maps it there)");
    }
    where_[name] = it->second;
  }
}

std::vector<float> SafetensorsWeights::to_f32(const std::string& name,
                                              const std::vector<std::int64_t>& expected_shape) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail(source_, "missing tensor '" + name + "'");
  return files_[it->second].to_f32(name, expected_shape);
}

}  // namespace kvscope::runner
