// KV cache slot lists.
#include "kvscope/runner/kv_cache.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvscope::runner {

void HeadCache::append(const float* key, const float* value, float bias, const SlotInfo& info) {
  keys_.insert(keys_.end(), key, key + head_dim_);
  values_.insert(values_.end(), value, value + head_dim_);
  bias_.push_back(bias);
  info_.push_back(info);
  ++version_;
}

void HeadCache::append_rows(const float* keys, const float* values, std::size_t row_stride,
                            const TokenInfo* tokens, int n) {
  if (n <= 0) return;
  const std::size_t dh = static_cast<std::size_t>(head_dim_), old = info_.size(),
                    un = static_cast<std::size_t>(n);
  keys_.resize((old + un) * dh);
  values_.resize((old + un) * dh);
  bias_.resize(old + un, 0.0f);
  info_.reserve(old + un);
  for (std::size_t i = 0; i < un; ++i) {
    std::copy_n(keys + i * row_stride, dh, keys_.data() + (old + i) * dh);
    std::copy_n(values + i * row_stride, dh, values_.data() + (old + i) * dh);
    info_.push_back(SlotInfo{tokens[i], 1});
  }
  ++version_;
}

namespace {
template <typename T>
void fit_vector(std::vector<T>& v, std::size_t capacity) {
  if (v.capacity() == capacity) return;
  std::vector<T> out;
  out.reserve(capacity);
  out.assign(v.begin(), v.end());
  v.swap(out);
}
}  // namespace

void HeadCache::fit(int extra) {
  const std::size_t slots = info_.size() + static_cast<std::size_t>(std::max(0, extra));
  const std::size_t dh = static_cast<std::size_t>(head_dim_);
  fit_vector(keys_, slots * dh);
  fit_vector(values_, slots * dh);
  fit_vector(bias_, slots);
  fit_vector(info_, slots);
}

void HeadCache::keep(const std::vector<bool>& mask) {
  if (mask.size() != info_.size()) {
    throw std::invalid_argument("HeadCache::keep: mask has " + std::to_string(mask.size()) + " entries for " +
                                std::to_string(info_.size()) + " slots");
  }
  const std::size_t dh = static_cast<std::size_t>(head_dim_);
  std::size_t out = 0;
  for (std::size_t s = 0; s < mask.size(); ++s) {
    if (!mask[s]) continue;
    if (out != s) {
      std::copy_n(keys_.begin() + static_cast<std::ptrdiff_t>(s * dh), dh,
                  keys_.begin() + static_cast<std::ptrdiff_t>(out * dh));
      std::copy_n(values_.begin() + static_cast<std::ptrdiff_t>(s * dh), dh,
                  values_.begin() + static_cast<std::ptrdiff_t>(out * dh));
      bias_[out] = bias_[s];
      info_[out] = info_[s];
    }
    ++out;
  }
  keys_.resize(out * dh);
  values_.resize(out * dh);
  bias_.resize(out);
  info_.resize(out);
  ++version_;
}

void HeadCache::set_slot(int s, const float* key, const float* value, float bias, std::int32_t multiplicity) {
  if (s < 0 || s >= size()) throw std::out_of_range("HeadCache::set_slot: slot " + std::to_string(s));
  std::copy_n(key, head_dim_, mutable_key(s));
  std::copy_n(value, head_dim_, mutable_value(s));
  bias_[static_cast<std::size_t>(s)] = bias;
  info_[static_cast<std::size_t>(s)].multiplicity = multiplicity;
  ++version_;
}

float* HeadCache::mutable_key(int s) {
  ++version_;
  return keys_.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(head_dim_);
}

float* HeadCache::mutable_value(int s) {
  ++version_;
  return values_.data() + static_cast<std::size_t>(s) * static_cast<std::size_t>(head_dim_);
}

KvCache::KvCache(int num_layers, int num_kv_heads, int head_dim)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {
  heads_.assign(static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(num_kv_heads),
                HeadCache(head_dim));
}

HeadCache& KvCache::head(int layer, int kv_head) {
  return heads_[static_cast<std::size_t>(layer * num_kv_heads_ + kv_head)];
}

const HeadCache& KvCache::head(int layer, int kv_head) const {
  return heads_[static_cast<std::size_t>(layer * num_kv_heads_ + kv_head)];
}

std::int64_t KvCache::total_slots() const {
  std::int64_t n = 0;
  for (const auto& h : heads_) n += h.size();
  return n;
}

void KvCache::fit(int extra) {
  for (auto& h : heads_) h.fit(extra);
}

}  // namespace kvscope::runner
