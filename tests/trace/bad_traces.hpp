// Makes small valid and deliberately broken trace files for the error tests:
// each case names the file it writes and the text the one-line error must contain.
#pragma once

#include <hdf5.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/writer.hpp"

namespace kvscope::testing {

// A small valid trace (tiny preset geometry, float16 unless told otherwise).
inline void write_small_trace(const std::string& path, trace::DType dtype = trace::DType::kF16,
                              std::uint64_t seed = 1) {
  synth::SynthOptions o;
  o.preset = "tiny";
  o.images = 1;
  o.image_tokens = 16;
  o.text = 8;
  o.decode = 3;
  o.seed = seed;
  o.dtype = dtype;
  synth::write_synthetic_trace(o, path);
}

struct BadCase {
  std::string name;      // short id, also the file stem
  std::string expect;    // substring the error message must contain
  std::function<void(const std::string& path)> make;
};

namespace detail {
inline hid_t open_rw(const std::string& p) { return H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT); }

inline void set_string_attr(hid_t f, const char* name, const std::string& v) {
  H5Adelete(f, name);
  hid_t t = H5Tcopy(H5T_C_S1);
  H5Tset_size(t, H5T_VARIABLE);
  hid_t s = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, t, s, H5P_DEFAULT, H5P_DEFAULT);
  const char* p = v.c_str();
  H5Awrite(a, t, &p);
  H5Aclose(a);
  H5Sclose(s);
  H5Tclose(t);
}

inline void set_num_attr(hid_t f, const char* name, hid_t ftype, hid_t mtype, const void* v) {
  H5Adelete(f, name);
  hid_t s = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, ftype, s, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, mtype, v);
  H5Aclose(a);
  H5Sclose(s);
}
inline void set_f64_attr(hid_t f, const char* name, double v) {
  set_num_attr(f, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}
inline void set_i64_attr(hid_t f, const char* name, std::int64_t v) {
  set_num_attr(f, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

// Replaces dataset `path` by one of type `type` and shape `dims` filled with zeros.
inline void replace_dataset(hid_t f, const std::string& path, hid_t type, std::vector<hsize_t> dims) {
  H5Ldelete(f, path.c_str(), H5P_DEFAULT);
  hid_t s = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t d = H5Dcreate2(f, path.c_str(), type, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  std::size_t n = 1;
  for (auto x : dims) n *= x;
  std::vector<unsigned char> zeros(n * H5Tget_size(type), 0);
  H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data());
  H5Dclose(d);
  H5Sclose(s);
}
}  // namespace detail

// tiny with image_tokens 16, text 8: T = 1 + 8 + 17 = 26 tokens, decode 3; Hq 4, Hkv 2, D 32.
inline std::vector<BadCase> bad_cases() {
  using namespace detail;
  std::vector<BadCase> c;
  c.push_back({"missing", "no such file", [](const std::string&) {}});
  c.push_back({"not_hdf5", "not an HDF5 file", [](const std::string& p) {
                 std::ofstream(p) << "this is a text file, not a trace\n";
               }});
  c.push_back({"truncated", "truncated", [](const std::string& p) {
                 write_small_trace(p);
                 std::filesystem::resize_file(p, std::filesystem::file_size(p) / 2);
               }});
  c.push_back({"empty_file", "not an HDF5 file", [](const std::string& p) { std::ofstream(p).flush(); }});
  c.push_back({"not_a_trace", "@format", [](const std::string& p) {
                 hid_t f = H5Fcreate(p.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
                 set_string_attr(f, "format", "something-else");
                 H5Fclose(f);
               }});
  c.push_back({"version", "unsupported trace version 2.0", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 set_string_attr(f, "version", "2.0");
                 H5Fclose(f);
               }});
  c.push_back({"missing_dataset", "/layers/002/v: dataset is missing", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 H5Ldelete(f, "/layers/002/v", H5P_DEFAULT);
                 H5Fclose(f);
               }});
  c.push_back({"missing_layer", "/layers/003: layer group is missing", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 H5Ldelete(f, "/layers/003", H5P_DEFAULT);
                 H5Fclose(f);
               }});
  c.push_back({"inconsistent_shape", "/layers/001/k: shape [2, 25, 32], expected [2, 26, 32]",
               [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 replace_dataset(f, "/layers/001/k", H5T_IEEE_F32LE, {2, 25, 32});
                 H5Fclose(f);
               }});
  c.push_back({"bad_modality", "bad modality code 7 at token 5", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 hid_t d = H5Dopen2(f, "/tokens/modality", H5P_DEFAULT);
                 std::vector<std::uint8_t> m(26);
                 H5Dread(d, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, m.data());
                 m[5] = 7;
                 H5Dwrite(d, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, m.data());
                 H5Dclose(d);
                 H5Fclose(f);
               }});
  c.push_back({"nan", "/layers/002/k: NaN at [1, 3, 4]", [](const std::string& p) {
                 write_small_trace(p, trace::DType::kF32);
                 hid_t f = open_rw(p);
                 hid_t d = H5Dopen2(f, "/layers/002/k", H5P_DEFAULT);
                 std::vector<float> k(2 * 26 * 32);
                 H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, k.data());
                 k[(1 * 26 + 3) * 32 + 4] = std::numeric_limits<float>::quiet_NaN();
                 H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, k.data());
                 H5Dclose(d);
                 H5Fclose(f);
               }});
  c.push_back({"inf_decode", "/decode/layers/000/q: Inf", [](const std::string& p) {
                 write_small_trace(p, trace::DType::kF32);
                 hid_t f = open_rw(p);
                 hid_t d = H5Dopen2(f, "/decode/layers/000/q", H5P_DEFAULT);
                 std::vector<float> q(4 * 3 * 32);
                 H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, q.data());
                 q[17] = std::numeric_limits<float>::infinity();
                 H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, q.data());
                 H5Dclose(d);
                 H5Fclose(f);
               }});
  c.push_back({"dtype_float64", "dtype float64 not allowed", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 replace_dataset(f, "/layers/000/q", H5T_IEEE_F64LE, {4, 26, 32});
                 H5Fclose(f);
               }});
  c.push_back({"dtype_uint16_no_attr", "uint16 tensor without attribute", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 replace_dataset(f, "/layers/000/k", H5T_STD_U16LE, {2, 26, 32});
                 H5Fclose(f);
               }});
  c.push_back({"dtype_mixed", "differs from the trace's float16", [](const std::string& p) {
                 write_small_trace(p);
                 hid_t f = open_rw(p);
                 replace_dataset(f, "/layers/002/v", H5T_IEEE_F32LE, {2, 26, 32});
                 H5Fclose(f);
               }});
  // Attribute values and declared sizes (more, made with h5py, in limits_h5py.py).
  auto edit = [](auto fn) {
    return [fn](const std::string& p) {
      write_small_trace(p);
      hid_t f = open_rw(p);
      fn(f);
      H5Fclose(f);
    };
  };
  for (const char* v : {" 1.0", "1.0abc", "1.0.0"}) {
    c.push_back({std::string("version_") + (v[0] == ' '                  ? "space"
                                            : std::string(v).size() == 6 ? "suffix"
                                                                         : "three"),
                 "is not MAJOR.MINOR", edit([v](hid_t f) { set_string_attr(f, "version", v); })});
  }
  // Control characters from the file are escaped in the message, which stays one line (a fuzzer find).
  c.push_back({"version_newlines", "'\\n\\n\\x01' is not MAJOR.MINOR",
               edit([](hid_t f) { set_string_attr(f, "version", "\n\n\x01"); })});
  c.push_back({"rope_theta_inf", "/@rope_theta: must be a finite number > 0", edit([](hid_t f) {
                 set_f64_attr(f, "rope_theta", std::numeric_limits<double>::infinity());
               })});
  c.push_back({"num_q_heads_fraction", "/@num_q_heads: must be an integer, got 4.5",
               edit([](hid_t f) { set_f64_attr(f, "num_q_heads", 4.5); })});
  c.push_back({"num_q_heads_1e5", "/@num_q_heads: 100000 is more than the limit of 1024",
               edit([](hid_t f) { set_i64_attr(f, "num_q_heads", 100000); })});
  c.push_back({"complete_negative", "/@complete: must be 0 or 1, got -1",
               edit([](hid_t f) { set_i64_attr(f, "complete", -1); })});
  c.push_back({"attn_window_longer_than_T",
               "/layers/000/attn_window: window W = 1000 must be between 1 and T = 26", edit([](hid_t f) {
                 replace_dataset(f, "/layers/000/attn_window", H5T_IEEE_F32LE, {4, 1000, 26});
               })});
  c.push_back({"grid_on_text_token", "/tokens/grid: token 1 is not a vision token but has grid cell (0, 0)",
               edit([](hid_t f) {
                 hid_t d = H5Dopen2(f, "/tokens/grid", H5P_DEFAULT);
                 std::vector<std::int32_t> g(26 * 2);
                 H5Dread(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, g.data());
                 g[2] = g[3] = 0;  // token 1 is text
                 H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, g.data());
                 H5Dclose(d);
               })});
  c.push_back({"zero_tokens", "T = 0: a trace needs at least one context token", edit([](hid_t f) {
                 replace_dataset(f, "/tokens/modality", H5T_STD_U8LE, {0});
                 for (const char* n : {"/tokens/position", "/tokens/token_id", "/tokens/segment"})
                   replace_dataset(f, n, H5T_STD_I32LE, {0});
                 replace_dataset(f, "/tokens/grid", H5T_STD_I32LE, {0, 2});
               })});
  c.push_back({"incomplete", "incomplete", [](const std::string& p) {
                 synth::SynthGenerator gen(synth::SynthOptions{});
                 trace::TraceWriter w(p, gen.header(), gen.num_tokens(), gen.num_decode_steps());
                 w.write_tokens(gen.tokens());
                 // The "capture" stops here: no layers, no close().
               }});
  return c;
}

}  // namespace kvscope::testing
