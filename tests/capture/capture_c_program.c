/* A C (not C++) client of kvscope_capture.h, proving the C ABI.
 *   capture_c_program roundtrip FILE  writes a complete trace (values by formula), exit 0
 *   capture_c_program crash FILE      records tokens and 2 of 4 layers, waits until they are
 *                                     on disk, then abort()s mid-capture (trace stays incomplete) */
#define _POSIX_C_SOURCE 199309L /* nanosleep */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvscope_capture.h"

enum { L = 4, HQ = 2, HKV = 1, D = 4, T = 6, S = 2 };

static void check(int status, const char* what) {
  if (status != KVSCOPE_OK) {
    fprintf(stderr, "%s failed (%d): %s\n", what, status, kvscope_capture_last_error());
    exit(1);
  }
}

/* value of element (h, t, d) of tensor `which` (0 q, 1 k, 2 v) of layer l */
static float value(int l, int which, int h, int t, int d) {
  return (float)(l * 1000 + which * 100 + h * 10 + t) + (float)d * 0.25f;
}

static kvscope_tensor make(const float* data, int heads, int tokens) {
  kvscope_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = KVSCOPE_F32;
  t.memory = KVSCOPE_HOST;
  t.shape[0] = heads;
  t.shape[1] = tokens;
  t.shape[2] = D;
  return t;
}

static void record_layer(kvscope_capture* c, int l) {
  float q[HQ * T * D], k[HKV * T * D], v[HKV * T * D];
  for (int h = 0; h < HQ; ++h)
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d) q[(h * T + t) * D + d] = value(l, 0, h, t, d);
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < D; ++d) {
      k[t * D + d] = value(l, 1, 0, t, d);
      v[t * D + d] = value(l, 2, 0, t, d);
    }
  kvscope_tensor tq = make(q, HQ, T), tk = make(k, HKV, T), tv = make(v, HKV, T);
  check(kvscope_capture_prefill_layer(c, l, &tq, &tk, &tv), "kvscope_capture_prefill_layer");
}

int main(int argc, char** argv) {
  if (argc != 3 || (strcmp(argv[1], "roundtrip") != 0 && strcmp(argv[1], "crash") != 0)) {
    fprintf(stderr, "usage: capture_c_program roundtrip|crash FILE\n");
    return 2;
  }
  const int crash = strcmp(argv[1], "crash") == 0;
  if (kvscope_capture_abi_version() != KVSCOPE_CAPTURE_ABI_VERSION) return 3;
  kvscope_capture_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.num_layers = L;
  cfg.num_q_heads = HQ;
  cfg.num_kv_heads = HKV;
  cfg.head_dim = D;
  cfg.rope_theta = 10000.0;
  cfg.model_name = "c-program";
  cfg.dtype = KVSCOPE_F32;
  cfg.max_decode_steps = S;
  cfg.profile = 1;
  kvscope_capture* c = NULL;
  check(kvscope_capture_open(argv[2], &cfg, T, &c), "kvscope_capture_open");

  uint8_t modality[T] = {KVSCOPE_SPECIAL, KVSCOPE_VISION, KVSCOPE_VISION,
                         KVSCOPE_VISION,  KVSCOPE_VISION, KVSCOPE_TEXT};
  int32_t position[T], token_id[T], segment[T], row[T], col[T];
  for (int i = 0; i < T; ++i) {
    const int vision = modality[i] == KVSCOPE_VISION;
    position[i] = i;
    token_id[i] = vision ? -1 : 7 + i;
    segment[i] = vision ? 1 : 0;
    row[i] = vision ? (i - 1) / 2 : -1;
    col[i] = vision ? (i - 1) % 2 : -1;
  }
  check(kvscope_capture_set_tokens(c, modality, position, token_id, segment, row, col, NULL),
        "kvscope_capture_set_tokens");
  check(kvscope_capture_range_push(c, "prefill"), "kvscope_capture_range_push");
  for (int l = 0; l < (crash ? 2 : L); ++l) record_layer(c, l);
  if (crash) {
    kvscope_capture_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    for (int i = 0; i < 10000; ++i) { /* wait (up to 10 s) until the writer has both layers on disk */
      check(kvscope_capture_get_stats(c, &st), "kvscope_capture_get_stats");
      if (st.layers_written == 2) break;
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
    abort(); /* a crash mid-capture */
  }
  check(kvscope_capture_range_pop(c), "kvscope_capture_range_pop");
  for (int s = 0; s < S; ++s) {
    for (int l = 0; l < L; ++l) {
      float q[HQ * D], kv[HKV * D];
      for (int i = 0; i < HQ * D; ++i) q[i] = value(l, 0, i / D, T + s, i % D);
      for (int i = 0; i < HKV * D; ++i) kv[i] = value(l, 1, 0, T + s, i % D);
      kvscope_tensor tq = make(q, HQ, 1), tk = make(kv, HKV, 1);
      check(kvscope_capture_decode_layer(c, l, s, &tq, &tk, &tk), "kvscope_capture_decode_layer");
    }
    check(kvscope_capture_decode_token(c, s, 40 + s, T + s, "x"), "kvscope_capture_decode_token");
  }
  check(kvscope_capture_close(c), "kvscope_capture_close");
  printf("wrote %s\n", argv[2]);
  return 0;
}
