/* A decode step over the INT4 KV heads of a compacted prefix read from their packed codes, on the CPU: each head's
 * softmax statistics as int4_head_stats.py defines them (same result up to rounding), merged with the appended
 * tokens' and normalised (int4_decode.py). Compiled and loaded by native_int4.py, whose docstring states the
 * arguments and shapes.
 *
 * Codes are packed two per byte, channel 2i in the low nibble of byte i and 2i + 1 in the high one, 4-bit two's
 * complement. Nothing is dequantised into memory: the scores are formed LANES entries at a time (each entry's codes
 * read as 32-bit words, each word holding 8 channels, one entry per lane), the value sums one entry at a time (its
 * codes widened 16 bytes at a time, the even channels in one vector and the odd ones in another), several query
 * rows at once so that every product has independent accumulation chains. Portable C with GCC/Clang vector
 * extensions; AVX-512 intrinsics where the compiler targets them (a gather and a byte widening), a scalar equivalent
 * elsewhere. No fast-math: infinities keep their IEEE meaning (a bias of -inf weighs exactly 0).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
#define LANES 16
#define MAX_DIM 256
#define ROW_GROUP 4
#define VALUE_GROUP 8

/* The 32-bit little-endian word at `words` of each of `count` entries `stride` bytes apart, one per lane (0 past
 * count). */
static inline vu entry_words(const uint8_t *words, int64_t stride, int64_t count) {
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 valid = (__mmask16)((1u << count) - 1u);
    const __m512i offsets = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)stride));
    return (vu)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, words, 1);
#else
    vu out = {0};
    for (int64_t l = 0; l < count; l++) memcpy((uint32_t *)&out + l, words + l * stride, 4);
    return out;
#endif
}

/* `count` <= LANES bytes sign-extended to int32 lanes (0 past count). */
static inline vi signed_bytes(const uint8_t *bytes, int64_t count) {
#if defined(__AVX512F__)
    if (count == LANES) return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bytes));
#endif
    vi out = {0};
    for (int64_t l = 0; l < count; l++) out[l] = (int8_t)bytes[l];
    return out;
}

static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* exp(x) per lane within 2 ulp on [-87, 88.5] (Cody-Waite reduction x = n ln2 + r, degree-6 polynomial of r, 2^n
 * from its exponent bits); 0 below, exp(-inf) included; +inf above. */
static inline vf exp_lanes(vf x) {
    const vf zero = {0}, low = zero - 87.0f, high = zero + 88.5f;
    const vi under = x < low, over = x > high;
    const vf clamped = pick(under, low, pick(over, high, x));
    const vf t = clamped * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(t, vi);
    n += __builtin_convertvector(n, vf) > t; /* truncation to floor: a true comparison is -1 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = clamped - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vf y = p * (vf)((n + 127) << 23);
    return pick(under, zero, pick(over, zero + INFINITY, y));
}

/* out[g] += q[g] . columns for `group` <= ROW_GROUP query rows: independent accumulation chains, one per row (called
 * with a constant group, so that the compiler keeps the accumulators in registers). */
static inline void row_scores(const float *query, int64_t dim, const vf *columns, vf *out, const int group) {
    vf acc[ROW_GROUP] = {{0}};
    for (int64_t c = 0; c < dim; c++)
        for (int g = 0; g < group; g++) acc[g] += query[g * dim + c] * columns[c];
    for (int g = 0; g < group; g++) out[g] = acc[g];
}

/* q . code of `count` <= LANES entries (row stride `half` bytes) for every query row: out[r] lane jj. */
static inline void block_scores(const uint8_t *codes, int64_t half, int64_t count, const float *query, int64_t rows,
                                int64_t dim, vf *columns, vf *out) {
    const int64_t words = half / 4;
    for (int64_t w = 0; w < words; w++) { /* nibble k of word w is channel 8w + k */
        const vu word = entry_words(codes + 4 * w, half, count);
        for (int k = 0; k < 8; k++) columns[8 * w + k] = __builtin_convertvector(((vi)(word << (28 - 4 * k))) >> 28, vf);
    }
    for (int64_t i = 4 * words; i < half; i++) { /* the bytes after the last whole word */
        vi byte = {0};
        for (int64_t l = 0; l < count; l++) byte[l] = (int8_t)codes[l * half + i];
        columns[2 * i] = __builtin_convertvector((byte << 28) >> 28, vf);
        columns[2 * i + 1] = __builtin_convertvector(byte >> 4, vf);
    }
    for (int64_t r = 0; r < rows; r += ROW_GROUP) {
        const float *q = query + r * dim;
        switch (rows - r < ROW_GROUP ? rows - r : ROW_GROUP) {
        case 1: row_scores(q, dim, columns, out + r, 1); break;
        case 2: row_scores(q, dim, columns, out + r, 2); break;
        case 3: row_scores(q, dim, columns, out + r, 3); break;
        default: row_scores(q, dim, columns, out + r, ROW_GROUP);
        }
    }
}

/* Value sums of one chunk of `count` <= LANES code bytes (2 LANES channels: the even ones in acc[g][0], the odd ones
 * in acc[g][1]) for `group` <= VALUE_GROUP query rows, whose weights are rows of `weights` (row stride `stride`),
 * written to rows of `value_sum` (row stride `value_dim`) from channel 2 v (called with a constant group). */
static inline void chunk_value_sums(const uint8_t *codes, int64_t value_half, int64_t count, const float *weights,
                                    int64_t stride, const float *value_scales, int64_t length, float *value_sum,
                                    int64_t value_dim, const int group) {
    vf acc[VALUE_GROUP][2] = {{{0}}};
    for (int64_t j = 0; j < length; j++) {
        const vi bytes = signed_bytes(codes + j * value_half, count);
        const vf even = __builtin_convertvector((bytes << 28) >> 28, vf), odd = __builtin_convertvector(bytes >> 4, vf);
        for (int g = 0; g < group; g++) {
            const float w = weights[g * stride + j] * value_scales[j];
            acc[g][0] += w * even;
            acc[g][1] += w * odd;
        }
    }
    for (int g = 0; g < group; g++)
        for (int64_t l = 0; l < count; l++) {
            value_sum[g * value_dim + 2 * l] = acc[g][0][l];
            value_sum[g * value_dim + 2 * l + 1] = acc[g][1][l];
        }
}

/* One head's softmax statistics over `length` INT4 entries for `rows` query rows: entry j scores
 * ((q . code_j) * key_scale[j] + offset[r]) * scaling + bias[j] (key_scale NULL: 1; channel scales folded into the
 * query by the caller), its value is code * value_scales[j]. */
static inline void head_stats(const float *query, const float *offset, float scaling, const uint8_t *key_codes,
                              const float *key_scale, const float *bias, const uint8_t *value_codes,
                              const float *value_scales, int64_t rows, int64_t length, const int64_t dim,
                              const int64_t value_dim, float *scores, float *row_max, float *exp_sum,
                              float *value_sum) {
    const int64_t half = dim / 2, value_half = value_dim / 2, stride = (length + LANES - 1) / LANES * LANES;
    vf columns[MAX_DIM];
    vf block[rows];
    for (int64_t j0 = 0; j0 < length; j0 += LANES) { /* scores; lanes past the last entry get -inf */
        const int64_t count = length - j0 < LANES ? length - j0 : LANES;
        block_scores(key_codes + j0 * half, half, count, query, rows, dim, columns, block);
        vf bias_block, key_block;
        for (int64_t jj = 0; jj < LANES; jj++) {
            bias_block[jj] = jj < count ? bias[j0 + jj] : -INFINITY;
            key_block[jj] = key_scale && jj < count ? key_scale[j0 + jj] : 1.0f;
        }
        for (int64_t r = 0; r < rows; r++) {
            const vf s = (block[r] * key_block + offset[r]) * scaling + bias_block;
            memcpy(scores + r * stride + j0, &s, sizeof s);
        }
    }
    for (int64_t r = 0; r < rows; r++) { /* row max, exp, sum; the weights replace the scores */
        float *s = scores + r * stride;
        vf best = (vf){0} - INFINITY;
        for (int64_t j = 0; j < stride; j += LANES) {
            vf x;
            memcpy(&x, s + j, sizeof x);
            best = pick(x > best, x, best);
        }
        float top = -INFINITY;
        for (int l = 0; l < LANES; l++) top = best[l] > top ? best[l] : top;
        row_max[r] = top;
        const float shift = isfinite(top) ? top : 0.0f; /* every score -inf: exp(-inf) = 0, not NaN */
        vf total = {0};
        for (int64_t j = 0; j < stride; j += LANES) {
            vf x;
            memcpy(&x, s + j, sizeof x);
            const vf w = exp_lanes(x - shift);
            total += w;
            memcpy(s + j, &w, sizeof w);
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += total[l];
        exp_sum[r] = sum;
    }
    /* value sums, one chunk of LANES code bytes and up to VALUE_GROUP rows at a time, so that the accumulators stay
     * in registers */
    for (int64_t v = 0; v < value_half; v += LANES) {
        const int64_t count = value_half - v < LANES ? value_half - v : LANES;
        for (int64_t r = 0; r < rows; r += VALUE_GROUP) {
#define CHUNK(G)                                                                                               \
    chunk_value_sums(value_codes + v, value_half, count, scores + r * stride, stride, value_scales, length, \
                     value_sum + r * value_dim + 2 * v, value_dim, G)
            switch (rows - r < VALUE_GROUP ? rows - r : VALUE_GROUP) {
            case 1: CHUNK(1); break;
            case 2: CHUNK(2); break;
            case 3: CHUNK(3); break;
            case 4: CHUNK(4); break;
            case 5: CHUNK(5); break;
            case 6: CHUNK(6); break;
            case 7: CHUNK(7); break;
            default: CHUNK(VALUE_GROUP);
            }
#undef CHUNK
        }
    }
}

static int dims_fit(int64_t dim, int64_t value_dim) {
    return dim > 0 && value_dim > 0 && dim <= MAX_DIM && value_dim <= MAX_DIM && dim % 2 == 0 && value_dim % 2 == 0;
}

/* The common head dimensions get their own constant-dimension copies, so that the compiler unrolls their loops. */
#define DISPATCH(CALL)                         \
    if (dim == 64 && value_dim == 64)          \
        CALL(64, 64);                          \
    else if (dim == 128 && value_dim == 128)   \
        CALL(128, 128);                        \
    else                                       \
        CALL(dim, value_dim);

/* An IEEE half (fp16) as float: normal, subnormal, zero, inf and NaN. */
static inline float half_to_float(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
    union { uint32_t i; float f; } bits;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f; /* 2^-24 */
        return sign ? -magnitude : magnitude;
    }
    bits.i = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
    return bits.f;
}

/* Merges the appended tokens into one query row: `out` holds the prefix's value sum on entry and the normalised
 * attention output on return (0 for a row that sees no key). */
static void merge_appended(const float *query, float scaling, const float *keys, const float *values,
                           const float *mask, int64_t appended, int64_t dim, int64_t value_dim, float row_max,
                           float exp_sum, float *scores, float *out) {
    float top = row_max;
    for (int64_t j = 0; j < appended; j++) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < dim; c++) dot += query[c] * keys[j * dim + c];
        scores[j] = dot * scaling + mask[j];
        top = scores[j] > top ? scores[j] : top;
    }
    const float shift = isfinite(top) ? top : 0.0f;
    const float prefix_scale = expf(row_max - shift); /* 0 where the prefix weighs nothing */
    float total = exp_sum * prefix_scale;
    for (int64_t c = 0; c < value_dim; c++) out[c] *= prefix_scale;
    for (int64_t j = 0; j < appended; j++) {
        const float w = expf(scores[j] - shift);
        total += w;
#pragma omp simd
        for (int64_t c = 0; c < value_dim; c++) out[c] += w * values[j * value_dim + c];
    }
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t c = 0; c < value_dim; c++) out[c] *= inverse;
}

/* The largest of the count head lengths (the score workspace is sized by it). */
static int64_t longest_of(const int64_t *lengths, int64_t count) {
    int64_t longest = 0;
    for (int64_t i = 0; i < count; i++) longest = lengths[i] > longest ? lengths[i] : longest;
    return longest;
}

/* The statistics of INT4 prefix head `h` (the `i`th of the call) for its batch * group query rows (row b * group + k:
 * query head h * group + k of batch row b): its per-channel key scales and offsets folded into the queries (`scaled`,
 * `offset`), its value scales read (`scales`), then head_stats into row_max, exp_sum, value_sum. */
static void prefix_stats(int64_t i, int64_t h, int64_t batch, int64_t query_heads, int64_t group, int64_t dim,
                         int64_t value_dim, const float *query, float scaling, const uint16_t *key_scales,
                         const uint16_t *key_offsets, const int64_t *scale_rows, const uint8_t *key_codes,
                         const uint8_t *value_codes, const uint16_t *value_scales, const int64_t *code_rows,
                         int64_t length, const float *bias, const int64_t *bias_starts, float *scaled, float *offset,
                         float *scales, float *scores, float *row_max, float *exp_sum, float *value_sum) {
    const int64_t rows = batch * group;
    float channel_scale[MAX_DIM], channel_offset[MAX_DIM];
    for (int64_t c = 0; c < dim; c++) {
        channel_scale[c] = half_to_float(key_scales[scale_rows[i] * dim + c]);
        channel_offset[c] = half_to_float(key_offsets[scale_rows[i] * dim + c]);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *q = query + ((r / group) * query_heads + h * group + r % group) * dim;
        float dot = 0.0f;
        for (int64_t c = 0; c < dim; c++) {
            scaled[r * dim + c] = q[c] * channel_scale[c];
            dot += q[c] * channel_offset[c];
        }
        offset[r] = dot;
    }
    for (int64_t j = 0; j < length; j++) scales[j] = half_to_float(value_scales[code_rows[i] + j]);
    const uint8_t *k = key_codes + code_rows[i] * (dim / 2), *v = value_codes + code_rows[i] * (value_dim / 2);
    const float *b = bias + bias_starts[i];
#define HEAD_STATS(D, DV) \
    head_stats(scaled, offset, scaling, k, NULL, b, v, scales, rows, length, D, DV, scores, row_max, exp_sum, value_sum)
    DISPATCH(HEAD_STATS)
#undef HEAD_STATS
}

/* A decode step (one query per row) of the INT4 KV heads `heads`: each head's prefix read from its codes, merged with
 * its appended tokens, normalised, written to its query heads' rows of `out`. Shapes and layouts in native_int4.py
 * (`native_int4_decode`). Returns 0, or 1 for dimensions that do not fit. */
int int4_decode_attention(int64_t batch, int64_t query_heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                          int64_t appended, int64_t mask_batch, int64_t count, const int64_t *heads,
                          const float *query, float scaling, const uint16_t *key_scales, const uint16_t *key_offsets,
                          const int64_t *scale_rows, const uint8_t *key_codes, const uint8_t *value_codes,
                          const uint16_t *value_scales, const int64_t *code_rows, const int64_t *lengths,
                          const float *bias, const int64_t *bias_starts, const float *appended_keys,
                          const float *appended_values, const float *mask, float *workspace, float *out) {
    if (!dims_fit(dim, value_dim)) return 1;
    const int64_t group = query_heads / kv_heads, rows = batch * group;
    const int64_t longest = longest_of(lengths, count);
    float *row_max = workspace, *exp_sum = row_max + rows, *scaled = exp_sum + rows, *offset = scaled + rows * dim;
    float *prefix_out = offset + rows, *scales = prefix_out + rows * value_dim, *appended_scores = scales + longest;
    float *scores = appended_scores + appended;
    for (int64_t i = 0; i < count; i++) {
        const int64_t h = heads[i];
        prefix_stats(i, h, batch, query_heads, group, dim, value_dim, query, scaling, key_scales, key_offsets,
                     scale_rows, key_codes, value_codes, value_scales, code_rows, lengths[i], bias, bias_starts,
                     scaled, offset, scales, scores, row_max, exp_sum, prefix_out);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row_batch = r / group, mask_row = mask_batch == 1 ? 0 : row_batch;
            const int64_t query_row = row_batch * query_heads + h * group + r % group;
            const int64_t tokens = (row_batch * kv_heads + h) * appended;
            float *o = out + query_row * value_dim;
            memcpy(o, prefix_out + r * value_dim, value_dim * sizeof(float));
            merge_appended(query + query_row * dim, scaling, appended_keys + tokens * dim,
                           appended_values + tokens * value_dim, mask + mask_row * appended, appended, dim, value_dim,
                           row_max[r], exp_sum[r], appended_scores, o);
        }
    }
    return 0;
}

/* The softmax statistics of the INT4 prefix heads `heads` at a decode step, unnormalised and without the appended
 * tokens: head i's rows b * group + k of row_max [count, batch * group], exp_sum and value_sum
 * [count, batch * group, value_dim]. Arguments as int4_decode_attention's; shapes in native_int4.py
 * (`native_int4_prefix_stats`). Returns 0, or 1 for dimensions that do not fit. */
int int4_prefix_stats(int64_t batch, int64_t query_heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                      int64_t count, const int64_t *heads, const float *query, float scaling,
                      const uint16_t *key_scales, const uint16_t *key_offsets, const int64_t *scale_rows,
                      const uint8_t *key_codes, const uint8_t *value_codes, const uint16_t *value_scales,
                      const int64_t *code_rows, const int64_t *lengths, const float *bias, const int64_t *bias_starts,
                      float *workspace, float *row_max, float *exp_sum, float *value_sum) {
    if (!dims_fit(dim, value_dim)) return 1;
    const int64_t group = query_heads / kv_heads, rows = batch * group;
    const int64_t longest = longest_of(lengths, count);
    float *scaled = workspace, *offset = scaled + rows * dim, *scales = offset + rows, *scores = scales + longest;
    for (int64_t i = 0; i < count; i++)
        prefix_stats(i, heads[i], batch, query_heads, group, dim, value_dim, query, scaling, key_scales, key_offsets,
                     scale_rows, key_codes, value_codes, value_scales, code_rows, lengths[i], bias, bias_starts,
                     scaled, offset, scales, scores, row_max + i * rows, exp_sum + i * rows,
                     value_sum + i * rows * value_dim);
    return 0;
}

/* Softmax statistics (row max, exp-sum, unnormalised value sum, as partitions.py defines them) of one INT4 store with
 * one FP16 scale per entry row for its keys and one for its values (quantize_int4's layout: an INT4 store of a
 * mixed-precision cache) at a decode step, for every batch row and KV head: output row (b * kv_heads + h) * group + k
 * is query head h * group + k of batch row b, whose score of entry j is (q . code_j * key_scale_j + offset) * scaling
 * with offset = offsets[row] (NULL: 0). Entry j of (b, h) is entry b * batch_stride + h * head_stride + j of the codes
 * (rows of dim / 2 and value_dim / 2 bytes) and the scales; visible [batch, length] (0: not seen). */
static void rows_stats(int64_t batch, int64_t kv_heads, int64_t group, int64_t length, int64_t dim, int64_t value_dim,
                       const float *query, const float *offsets, float scaling, const uint8_t *key_codes,
                       const uint16_t *key_scales, const uint8_t *value_codes, const uint16_t *value_scales,
                       int64_t batch_stride, int64_t head_stride, const uint8_t *visible, float *workspace,
                       float *row_max, float *exp_sum, float *value_sum) {
    float *key_row = workspace, *value_row = key_row + length, *bias = value_row + length, *zeros = bias + length;
    float *scores = zeros + group;
    for (int64_t g = 0; g < group; g++) zeros[g] = 0.0f;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t j = 0; j < length; j++) bias[j] = visible[b * length + j] ? 0.0f : -INFINITY;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t first = b * batch_stride + h * head_stride, rows = (b * kv_heads + h) * group;
            for (int64_t j = 0; j < length; j++) {
                key_row[j] = half_to_float(key_scales[first + j]);
                value_row[j] = half_to_float(value_scales[first + j]);
            }
            const uint8_t *k = key_codes + first * (dim / 2), *v = value_codes + first * (value_dim / 2);
            const float *offset = offsets ? offsets + rows : zeros;
#define ROWS_STATS(D, DV)                                                                                       \
    head_stats(query + rows * dim, offset, scaling, k, key_row, bias, v, value_row, group, length, D, DV, scores, \
               row_max + rows, exp_sum + rows, value_sum + rows * value_dim)
            DISPATCH(ROWS_STATS)
#undef ROWS_STATS
        }
    }
}

/* rows_stats of `count` INT4 stores of one layer in one call, store i with lengths[i] entries, its own queries
 * (queries + i * rows * dim, rows = batch * kv_heads * group), offsets (offsets + i * rows, or none when offsets is
 * NULL), codes, scales, strides and visibility (arrays of one pointer or stride per store), and its statistics at
 * row_max + i * rows, exp_sum + i * rows and value_sum + i * rows * value_dim. workspace: 3 * longest + group +
 * group * padded(longest) floats. Shapes and layouts in native_int4.py (`native_int4_rows_stats`). Returns 0, or 1
 * for dimensions that do not fit. */
int int4_rows_stats(int64_t count, int64_t batch, int64_t kv_heads, int64_t group, const int64_t *lengths, int64_t dim,
                    int64_t value_dim, const float *queries, const float *offsets, float scaling,
                    const uint8_t *const *key_codes, const uint16_t *const *key_scales,
                    const uint8_t *const *value_codes, const uint16_t *const *value_scales,
                    const int64_t *batch_strides, const int64_t *head_strides, const uint8_t *const *visible,
                    float *workspace, float *row_max, float *exp_sum, float *value_sum) {
    if (!dims_fit(dim, value_dim)) return 1;
    const int64_t rows = batch * kv_heads * group;
    for (int64_t i = 0; i < count; i++)
        rows_stats(batch, kv_heads, group, lengths[i], dim, value_dim, queries + i * rows * dim,
                   offsets ? offsets + i * rows : NULL, scaling, key_codes[i], key_scales[i], value_codes[i],
                   value_scales[i], batch_strides[i], head_strides[i], visible[i], workspace, row_max + i * rows,
                   exp_sum + i * rows, value_sum + i * rows * value_dim);
    return 0;
}
