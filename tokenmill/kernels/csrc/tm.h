/* tokenmill CPU kernels: the C interface (loaded with ctypes by tokenmill/kernels/lib.py).
 *
 * One shared library per instruction set is built from the same sources; every entry point
 * takes raw pointers and sizes and trusts them (lib.py checks shapes, dtypes and contiguity).
 * Tensors are row-major; dtype codes: TM_F32 = float32, TM_BF16 = bfloat16. */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library exports these functions only (it is built with -fvisibility=hidden, so the
 * kernels' internal calls are direct and can be inlined). */
#define TM_API __attribute__((visibility("default")))

enum { TM_F32 = 0, TM_BF16 = 1 };
/* Block-quantized weights (quant.cpp): w = d * code + m per 32 k, codes of 4, 5 or 8 bits; with
 * TM_QSYM added, m = -2^(bits - 1) d (GGUF's Q4_0, Q5_0, Q8_0) and only d is stored; with
 * TM_QSUPER (4 and 5 bits, k a multiple of 256: GGUF's Q4_K, Q5_K), d = sc D and m = -mn M
 * from 6-bit integers sc, mn per 32 k and float16 D, M per 256 k. TM_QI6 | TM_QSUPER (GGUF's
 * Q6_K, k a multiple of 256): w = sc D (code - 32), 6-bit codes, an int8 sc per 16 k and a
 * float16 D per 256 k */
enum { TM_QI4 = 4, TM_QI5 = 5, TM_QI6 = 6, TM_QI8 = 8, TM_QSYM = 16, TM_QSUPER = 32 };
#define TM_ABI_VERSION 25
#define TM_MAX_RUNS 4

/* A linear layer's (n, k) weight: with quant 0, in this build's packed layout (tm_pack_weight,
 * the model's dtype); with a quant code (TM_QI4 / TM_QI5 / TM_QI8, + TM_QSYM), repacked by
 * tm_qpack. */
typedef struct {
  const void* packed;
  const float* bias; /* (n,) float32 or NULL */
  int64_t n, k;
  int32_t quant;
  /* 1: every input row is computed as a lone row is (the one-row micro-kernel), so a row's
   * result does not depend on the rows batched with it (batch-invariant mode) */
  int32_t row_invariant;
  /* 1: the rows were packed gate and up interleaved, tm_panel_rows() / 2 at a time (n: both);
   * the output is silu(gate) x up, (m, n / 2) */
  int32_t gated;
  /* Block-quantized rows in runs of their own code width (a fused q|k|v whose v has more bits
   * than q and k): run s holds rows [run_end[s - 1], run_end[s]) in run_quant[s]'s layout,
   * packed right after run s - 1 (tm_qpacked_bytes); runs 0: all rows in `quant` */
  int32_t runs;
  int32_t run_quant[TM_MAX_RUNS];
  int64_t run_end[TM_MAX_RUNS];
} tm_linear;

/* One decoder layer, named as in models/llama.py. Norm weights are in the model's dtype;
 * q_norm / k_norm are NULL when the model has none. With pre_ffn_norm (Gemma 3) the layer is
 * input_norm -> attention -> post_norm (of the attention output) -> residual add ->
 * pre_ffn_norm -> MLP -> post_ffn_norm; without it (Llama) post_norm follows the residual add
 * and the MLP output goes to the residual as it is. cos_sin: this layer's rotary table, NULL
 * = the model's. pool / pool_layer: which KV pool (tm_kv_pool) holds this layer, at what
 * index within it. */
typedef struct {
  const void* input_norm;
  const void* post_norm;
  const void* q_norm;
  const void* k_norm;
  const void* pre_ffn_norm;
  const void* post_ffn_norm;
  tm_linear qkv, o, gate_up, down;
  int64_t window; /* sliding window in tokens, 0 = none */
  const float* cos_sin;
  int64_t pool, pool_layer;
} tm_layer;

/* One KV block pool of a decode step: its caches (num_blocks, block_size, kv_heads, head_dim)
 * per layer, each new token's slot, the block tables (batch, max_blocks) and sequence lengths;
 * an int4 cache also each new token's stage row and each row's own block's stage slot. */
typedef struct {
  void *k, *v;
  int64_t num_blocks;
  const int64_t* slots;
  const int64_t* tables;
  int64_t max_blocks;
  const int64_t* lens;
  const int64_t* stage_rows;
  const int64_t* stages;
} tm_kv_pool;

#define TM_ACT_SILU 0
#define TM_ACT_GELU_TANH 1

/* What the fused decode step reads: the layers, the final norm and the rotary table; and how
 * its KV cache stores values: kv_format 0 = in the model's dtype, else TM_KV_INT8 / INT4 / FP8
 * (K's format; int4's V is TM_KV_INT4V) with the caches' codes and, for every layer, their
 * per-token scales (int4 K: none; its per-block params and its stage in the model's dtype),
 * and int4's V rotation. */
typedef struct {
  int32_t dtype;
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  int32_t act; /* TM_ACT_SILU or TM_ACT_GELU_TANH: act(gate) * up */
  const tm_layer* layers;
  const void* final_norm;
  const float* cos_sin; /* (2, max_positions, head_dim / 2) float32: cos, sin per frequency */
  int64_t max_positions;
  int32_t kv_format;
  const uint16_t *k_scale, *v_scale;
  const uint8_t* k_params;
  void* k_stage;
  int64_t stage_slots;
  const float* v_rotation; /* (head_dim, head_dim) or NULL */
} tm_decoder;

TM_API int tm_abi_version(void);
TM_API const char* tm_isa(void);
TM_API const char* tm_source_hash(void);
TM_API void tm_set_num_threads(int threads);
/* 1: the bf16 dot-product GEMM (AVX512-BF16 / AMX builds) prefetches the weights of calls of up
 * to 4 rows with prefetchnta, 0 (the default): into L2; the same results either way */
TM_API void tm_set_stream_prefetch(int nta);

TM_API int64_t tm_panel_rows(void);
TM_API int64_t tm_packed_numel(int dtype, int64_t n, int64_t k);
TM_API void tm_pack_weight(int dtype, const void* w, int64_t n, int64_t k, void* out);
/* tm_pack_weight's inverse: rows of a packed (n, k) weight, row-major, in its dtype: `count`
 * rows (rows[i]), or all n when rows is NULL; returns 0, or -1 (nothing written) when a row
 * index is outside [0, n) */
TM_API int tm_unpack_weight(int dtype, const void* packed, int64_t n, int64_t k,
                            const int64_t* rows, int64_t count, void* out);
/* Block-quantized weights: codes (n, k) uint8 and float16 d, m (n, k / 32), w = d * code + m,
 * repacked for the kernels (quant: TM_QI4 / TM_QI5 / TM_QI8, plus TM_QSYM where every m is
 * -2^(bits - 1) d: m is then not read and may be NULL; k a multiple of 32); tm_qdequantize
 * gives `count` rows (rows[i], or row i when rows is NULL) back in float32, and returns 0, or
 * -1 (nothing written) when a row index is outside [0, n). tm_quant_fast: 1 when this build
 * has the integer dot-product kernel (else a portable loop runs). */
TM_API int tm_quant_fast(void);
/* Q6_K weights (TM_QI6 | TM_QSUPER) on the AVX2 tiles: a call's chunk of at least `rows` input
 * rows (default 32; at most 64 a chunk) widens each group to a byte a code once instead of
 * unpacking the codes in every row tile; the same results either way. tm_q6_widens: 1 when
 * this build widens (the AVX2 tiles), else 0 and the setting is not read */
TM_API void tm_set_q6_widen_rows(int64_t rows);
TM_API int tm_q6_widens(void);
TM_API int64_t tm_qpacked_bytes(int quant, int64_t n, int64_t k);
TM_API void tm_qpack(int quant, const uint8_t* codes, const uint16_t* d, const uint16_t* m,
                     int64_t n, int64_t k, uint8_t* out);
/* TM_QSUPER weights (quant 4 or 5 plus TM_QSUPER): codes as tm_qpack's, sc and mn (n, k / 32)
 * uint8 below 64, D and M (n, k / 256) float16. TM_QI6 | TM_QSUPER: codes below 64, sc
 * (n, k / 16) int8, D (n, k / 256) float16; mn and M not read (may be NULL) */
TM_API void tm_qpack_super(int quant, const uint8_t* codes, const uint8_t* sc, const uint8_t* mn,
                           const uint16_t* D, const uint16_t* M, int64_t n, int64_t k,
                           uint8_t* out);
/* A GGUF matrix (n, k) straight from its file blocks (`data`: n rows of row_bytes, k / block
 * weights' blocks each, contiguous; ggml type ids Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), packed
 * as the form tm_gguf_quant(type) names (TM_QSYM for Q4_0, Q5_0, Q8_0; TM_QSUPER for the K
 * formats; TM_QI6 | TM_QSUPER for Q6_K), tm_qpacked_bytes of it at out. tm_gguf_quant: -1
 * for other types. tm_qpack_gguf returns 0, -1 (nothing written) for another type, k not a
 * multiple of the type's block or row_bytes not its blocks' bytes (n 0: only these checks),
 * -2 when a float16 scale in the file is inf or NaN. */
TM_API int tm_gguf_quant(int type);
TM_API int tm_qpack_gguf(int type, const uint8_t* data, int64_t row_bytes, int64_t n, int64_t k,
                         uint8_t* out);
TM_API int tm_qdequantize(int quant, const uint8_t* packed, int64_t n, int64_t k,
                           const int64_t* rows, int64_t count, float* out);
/* out (m, n) in out_dtype = x (m, k) @ w.T + bias; x in the packed weight's dtype, or float32 /
 * bfloat16 for quantized weights (quantized per 32 to int8 inside). prompt_rows: `ranges`
 * ascending row ranges [begin, end) (2 x ranges values) holding prompt tokens: of bf16 x
 * against block-quantized codes, the AMX build multiplies them by the weights dequantized to bf16
 * instead (other rows, and other builds: the int8 path; a row's bits never depend on the
 * rows beside it) */
TM_API void tm_linear_fwd(int dtype, const void* x, int64_t m, const tm_linear* w,
                          int out_dtype, void* out, const int64_t* prompt_rows, int64_t ranges);

/* out = w * normalize(x); with add: x = x + add first (x is the residual stream) */
TM_API void tm_rms_norm(int dtype, void* x, const void* w, const void* add, void* out,
                        int64_t rows, int64_t hidden, float eps);
/* in place on x (tokens, heads, head_dim), rotate-half layout; cos_sin (2, max_positions,
   head_dim / 2): each frequency's cos and sin once, for both halves */
TM_API void tm_rope(int dtype, void* x, int64_t tokens, int64_t heads, int64_t head_dim,
                    const float* cos_sin, int64_t max_positions, const int64_t* positions);
/* qkv (tokens, ld): per row heads q, kv_heads k, kv_heads v of head_dim each -> q (tokens,
   heads, head_dim) and k (tokens, kv_heads, head_dim) rotated as tm_rope, and k, v into
   k_cache / v_cache rows slots[t] (each kv_heads * head_dim wide) */
TM_API void tm_rope_store(int dtype, const void* qkv, int64_t ld, int64_t tokens, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, const float* cos_sin,
                          int64_t max_positions, const int64_t* positions, void* q, void* k,
                          void* k_cache, void* v_cache, const int64_t* slots);
/* x (rows, 2 * inter) = [gate | up] -> out (rows, inter) = silu(gate) * up */
TM_API void tm_silu_mul(int dtype, const void* x, void* out, int64_t rows, int64_t inter);
/* the same with GELU's tanh approximation (GeGLU) */
TM_API void tm_gelu_tanh_mul(int dtype, const void* x, void* out, int64_t rows, int64_t inter);
/* first index of each row's maximum (NaN counts as the largest) */
TM_API void tm_argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out);
/* one token per row of float32 logits (rows, vocab) drawn with the row's temperature, top_k
 * (0: off), top_p (1: off), min_p (0: off) and uniform u in [0, 1), as layers/sampler.py's
 * reference draws it; -1 for a row it leaves to the caller (temperature 0, a NaN, all -inf) */
TM_API void tm_sample_rows(const float* logits, int64_t rows, int64_t vocab,
                           const float* temperatures, const int64_t* top_k, const float* top_p,
                           const float* min_p, const float* u, int64_t* out);
/* q (batch, heads, head_dim) against one layer's paged cache (blocks, block_size, kv_heads,
 * head_dim); block_tables (batch, max_blocks); window 0 = unlimited */
TM_API void tm_decode_attention(int dtype, const void* q, const void* k_cache,
                                const void* v_cache, int64_t block_size, int64_t kv_heads,
                                const int64_t* block_tables, int64_t max_blocks,
                                const int64_t* seq_lens, int64_t batch, int64_t heads,
                                int64_t head_dim, int64_t window, float scale, void* out);
/* causal attention of a prefill chunk: q (n_new, heads, head_dim) at positions
 * [num_computed, num_computed + n_new) against its sequence's paged K/V (the chunk's own
 * already stored) through block_table; window 0 = unlimited */
TM_API void tm_prefill_attention(int dtype, const void* q, int64_t n_new, int64_t heads,
                                 int64_t head_dim, const void* k_cache, const void* v_cache,
                                 int64_t block_size, int64_t kv_heads,
                                 const int64_t* block_table, int64_t num_computed,
                                 int64_t window, float scale, void* out);
/* One layer's quantized paged K or V (layers/kv_quant.py, kv_int4.py): codes (blocks,
 * block_size, kv_heads, width) and an fp16 scale per token and head (int8, fp8, int4 V). int4 K
 * has instead params per (block, head) (2 head_dim + 4 bytes: kv_pages.h) and the stage, the
 * rows of blocks not yet full: (slots, block_size, kv_heads, head_dim) in stage_dtype. */
enum { TM_KV_INT8 = 1, TM_KV_INT4 = 2, TM_KV_FP8 = 3, TM_KV_INT4V = 4 };
typedef struct {
  int32_t format;
  const void* codes;
  const uint16_t* scale;
  const uint8_t* params;
  void* stage;
  int32_t stage_dtype;
} tm_kv_pages;
/* write x (tokens, kv_heads, head_dim <= 256) float32 into the pages at slots (tokens,): int8,
 * fp8 quantized; int4 V rotated by `rotation` (head_dim, head_dim), then quantized; int4 K into
 * the stage at stage_rows (tokens,), then every block whose last row was written is quantized
 * from its stage slot */
TM_API void tm_kv_store(int format, const float* x, int64_t tokens, int64_t kv_heads,
                        int64_t head_dim, const float* rotation, const int64_t* slots,
                        const int64_t* stage_rows, int64_t block_size, const tm_kv_pages* pages);
/* prefill attention as tm_prefill_attention, on a quantized cache; q and out TM_F32 / TM_BF16;
 * int4: stage_table (as block_table) holds the stage slot of each block not yet full */
TM_API void tm_prefill_attention_quant(int dtype, const void* q, int64_t n_new, int64_t heads,
                                       int64_t head_dim, const tm_kv_pages* k,
                                       const tm_kv_pages* v, int64_t block_size, int64_t kv_heads,
                                       const int64_t* block_table, const int64_t* stage_table,
                                       int64_t num_computed, int64_t window, float scale,
                                       void* out);
/* decode attention as tm_decode_attention, on a quantized cache; q and out float32 (int4: the
 * output in V's rotated basis); int4: stages (batch,) the stage slot of each row's own block.
 * invariant: a row's positions are never split between tasks (its sums do not depend on the
 * batch: batch-invariant mode) */
TM_API void tm_decode_attention_quant(const float* q, const tm_kv_pages* k, const tm_kv_pages* v,
                                      int64_t block_size, int64_t kv_heads,
                                      const int64_t* block_tables, int64_t max_blocks,
                                      const int64_t* seq_lens, const int64_t* stages,
                                      int64_t batch, int64_t heads, int64_t head_dim,
                                      int64_t window, float scale, float* out);
/* every decoder layer of a step: x (batch, hidden) holds the embeddings and receives the
 * final norm's output; caches (layers, blocks, block_size, kv_heads, head_dim). Without chunks
 * every row is a decode row; else rows [0, chunk_starts[0]) are decode rows and chunk c (of an
 * unquantized cache) is one sequence's prefill rows [chunk_starts[c], chunk_starts[c + 1]),
 * its block table and length (after the chunk) row chunk_starts[0] + c of each pool's.
 * prompt_rows, ranges: the step's prompt tokens, for every layer's tm_linear_fwd.
 * out_rows (ascending, beginning with every decode row; NULL: all rows): the rows whose output
 * the step uses; the last layer's attention and everything after it run on those alone, and
 * x rows [0, outs) receive their output (as llama.cpp's output ids). */
TM_API void tm_decode_stack(const tm_decoder* model, void* x, int64_t batch,
                            const int64_t* positions, const tm_kv_pool* pools,
                            int64_t block_size, const int64_t* chunk_starts, int64_t chunks,
                            const int64_t* prompt_rows, int64_t ranges, const int64_t* out_rows,
                            int64_t outs);

#ifdef __cplusplus
}
#endif
