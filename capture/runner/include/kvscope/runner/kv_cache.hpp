// The runner's KV cache: per layer and per KV head, a list of slots. A slot holds a key (after RoPE), a
// value and an additive attention-logit bias (log of its multiplicity; 0 for a plain token), plus the
// metadata of the token(s) it came from. Policies (issue 6) evict, merge and quantize slots per head
// independently through a CacheHook; attention of a query over a head's slots adds the bias, so a cache
// nobody touched gives exactly plain causal attention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvscope::runner {

// Where a token came from (also the trace labels of the spec).
struct TokenInfo {
  std::int32_t token_id = -1;  // -1 for vision patches
  std::int32_t position = 0;   // RoPE position
  std::uint8_t modality = 0;   // 0 text, 1 vision, 2 audio, 3 special
  std::int32_t segment = 0;    // image index for vision tokens; number of images for text
  std::int32_t grid_row = -1;  // vision: patch row, else -1
  std::int32_t grid_col = -1;
  std::int32_t index = 0;  // index in the sequence (context tokens, then decode tokens)
};

struct SlotInfo {
  TokenInfo token;                // the token the slot started as (for merged slots: the kept one)
  std::int32_t multiplicity = 1;  // tokens merged into this slot
};

class HeadCache {
 public:
  explicit HeadCache(int head_dim) : head_dim_(head_dim) {}

  int size() const { return static_cast<int>(info_.size()); }
  int head_dim() const { return head_dim_; }
  const float* keys() const { return keys_.data(); }      // [size, head_dim]
  const float* values() const { return values_.data(); }  // [size, head_dim]
  const float* biases() const { return bias_.data(); }    // [size]
  const float* key(int s) const { return keys_.data() + static_cast<std::size_t>(s) * head_dim_; }
  const float* value(int s) const { return values_.data() + static_cast<std::size_t>(s) * head_dim_; }
  float bias(int s) const { return bias_[static_cast<std::size_t>(s)]; }
  const SlotInfo& info(int s) const { return info_[static_cast<std::size_t>(s)]; }

  // Mutators (each bumps version(), so device mirrors know to refresh).
  void append(const float* key, const float* value, float bias, const SlotInfo& info);
  // Appends n plain slots (bias 0, multiplicity 1) for tokens[0..n): slot i's key and value are the
  // head_dim floats at keys + i * row_stride and values + i * row_stride (a prefill's [T, heads * head_dim]
  // rows). One growth of the storage instead of n.
  void append_rows(const float* keys, const float* values, std::size_t row_stride, const TokenInfo* tokens,
                   int n);
  // Keeps the slots whose mask entry is true, in order (eviction). mask.size() must equal size().
  void keep(const std::vector<bool>& mask);
  // Overwrites a slot's key/value (merge result or dequantized values) and its bias and multiplicity.
  void set_slot(int s, const float* key, const float* value, float bias, std::int32_t multiplicity);
  float* mutable_key(int s);
  float* mutable_value(int s);
  // Holds exactly size() + extra slots of memory (frees what an eviction left; appending `extra` more slots
  // then reallocates nothing).
  void fit(int extra);

  std::uint64_t version() const { return version_; }

 private:
  int head_dim_;
  std::vector<float> keys_, values_, bias_;
  std::vector<SlotInfo> info_;
  std::uint64_t version_ = 0;
};

class KvCache {
 public:
  KvCache(int num_layers, int num_kv_heads, int head_dim);
  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  HeadCache& head(int layer, int kv_head);
  const HeadCache& head(int layer, int kv_head) const;
  // Total slots over all layers and heads (for byte accounting: x head_dim x 2 x element bytes).
  std::int64_t total_slots() const;
  // HeadCache::fit(extra) on every head.
  void fit(int extra);

 private:
  int num_layers_, num_kv_heads_, head_dim_;
  std::vector<HeadCache> heads_;  // [layer * num_kv_heads + kv_head]
};

// Applied by generate(): after_prefill once the prompt's K/V are cached (the first answer token is already
// chosen from full attention), after_decode_step after each fed token's K/V are appended.
class CacheHook {
 public:
  virtual ~CacheHook() = default;
  virtual void after_prefill(KvCache& cache, const std::vector<TokenInfo>& context) = 0;
  virtual void after_decode_step(KvCache& cache, int step, const TokenInfo& token) = 0;
};

}  // namespace kvscope::runner
