// Adam / AdamW over fp32 parameters with the moments kept in bf16 (optimizer_state="bf16"); the gradients in fp32, or
// in bf16 as a bf16 matmul gives them (read as they are: two bytes less per parameter than widened first).
//
// The arithmetic is torch's fused Adam's, in fp32 (PyTorch aten/src/ATen/native/cpu/FusedAdamKernel.cpp: the same
// formulas, not its code). Each moment is read from bf16, updated in fp32 and stored back with stochastic rounding:
// with round-to-nearest, exp_avg_sq's per-step change (1 - beta2 = 0.1 %) is below half a bf16 unit (0.2 %) and would
// be lost; rounding up with probability equal to the dropped fraction keeps the expected value exact. The random bits
// are a hash of (seed, element index), so a step is reproducible, whatever the split among threads.
//
// The random bits of an element depend on its index in its whole parameter, not on how the parameter was cut (a row
// range, or rows gathered from anywhere). Where given, ``copy`` receives the updated parameter in bf16, rounded to
// nearest even as torch's casts round (a delayed block's weights of the next step, engine/delay.py): two bytes written
// in the same pass instead of a second pass over the parameter. ``copy`` may be the bf16 gradient itself: each element
// is then written where its gradient was read, through the gradient's pointer (the delayed block's next weights take
// its gradient's place). Built by adam_bf16.py with -O3: the loops vectorize.

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MIN_PARALLEL (1 << 16)  // elements: fewer run on the calling thread (a parallel region costs microseconds)

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f, uint32_t noise) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t finite = (u & 0x7f800000u) != 0x7f800000u;  // Inf and NaN keep their bits
    return (uint16_t)((u + (noise & 0xffffu) * finite) >> 16);
}

static inline uint16_t nearest(float f) {  // torch's fp32 -> bf16: round to nearest even, a NaN to the quiet NaN
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

static inline uint32_t mix(uint32_t x) {  // MurmurHash3's 32-bit finalizer
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

// One element: p fp32; g fp32, or bf16 bits with ``bf16_grad``; m, v (and vmax with amsgrad) bf16 bits; at its
// index ``at`` among the arrays, ``index`` in its whole parameter. The constants come computed (adam_bf16.py), so
// that this code and its torch reference round the same values: sign (the gradient's factor: 1 / grad_scale, negated
// to maximize), keep (AdamW's 1 - lr * weight_decay, else 1), l2 (Adam's weight_decay, else 0), b1c = 1 - beta1,
// b2c = 1 - beta2, step_size = lr / (1 - beta1^t), inv_bias2_sqrt = 1 / sqrt(1 - beta2^t). ``copies``: 0 none, 1
// into ``copy``, 2 into the (bf16) gradient. ``amsgrad``, ``copies`` and ``bf16_grad`` are constants where it is
// inlined: each loop vectorizes.
#define ARRAYS float *restrict p, void *restrict g, uint16_t *restrict m, uint16_t *restrict v, \
               uint16_t *restrict vmax, uint16_t *restrict copy
#define SCALARS float sign, float keep, float l2, float b1c, float beta2, float b2c, float eps, float step_size, \
                float inv_bias2_sqrt, uint32_t seed
#define PASS p, g, m, v, vmax, copy, sign, keep, l2, b1c, beta2, b2c, eps, step_size, inv_bias2_sqrt, seed

static inline void update(int64_t at, int64_t index, const int amsgrad, const int copies, const int bf16_grad, ARRAYS,
                          SCALARS) {
    float gi = bf16_grad ? widen(((const uint16_t *)g)[at]) : ((const float *)g)[at];
    float grad = gi * sign + l2 * p[at];
    float param = p[at] * keep;
    float mi = widen(m[at]);
    float vi = widen(v[at]);
    mi = mi + b1c * (grad - mi);
    vi = beta2 * vi + b2c * grad * grad;
    float second = vi;
    uint32_t bits = mix(((uint32_t)index * 0x9e3779b9u) ^ seed);
    if (amsgrad) {
        float most = widen(vmax[at]);
        second = most > vi ? most : vi;  // torch.maximum's but for a NaN already stored (fmaxf does not vectorize)
        vmax[at] = narrow(second, mix(bits));
    }
    float updated = param - step_size * mi / (sqrtf(second) * inv_bias2_sqrt + eps);
    p[at] = updated;
    if (copies == 1) copy[at] = nearest(updated);
    if (copies == 2) ((uint16_t *)g)[at] = nearest(updated);
    m[at] = narrow(mi, bits);
    v[at] = narrow(vi, bits >> 16);
}

// n contiguous elements, the first at ``index0`` in its parameter; vmax and copy NULL where not kept; ``bf16_grad``:
// the gradient is bf16. ``threads``: OpenMP's, torch's own runtime where it ships one (adam_bf16.py links it): idle
// torch threads spinning beside a second pool of threads slowed the update by a third. One loop per case, each with
// constant flags: each vectorizes.
#define LOOP(AMSGRAD, COPIES, BF16_GRAD)                                                        \
    _Pragma("omp parallel for simd schedule(static) num_threads(threads) if (n >= MIN_PARALLEL)") \
    for (int64_t i = 0; i < n; i++) update(i, index0 + i, AMSGRAD, COPIES, BF16_GRAD, PASS)
#define LOOPS(AMSGRAD, COPIES)        \
    do {                              \
        if (bf16_grad)                \
            LOOP(AMSGRAD, COPIES, 1); \
        else                          \
            LOOP(AMSGRAD, COPIES, 0); \
    } while (0)

#define BY_COPIES(AMSGRAD)     \
    do {                       \
        if (copies == 2)       \
            LOOPS(AMSGRAD, 2); \
        else if (copies)       \
            LOOPS(AMSGRAD, 1); \
        else                   \
            LOOPS(AMSGRAD, 0); \
    } while (0)

void adam_bf16(int64_t n, int64_t index0, int threads, int bf16_grad, ARRAYS, SCALARS) {
    int copies = copy == NULL ? 0 : copy == (uint16_t *)g ? 2 : 1;
    if (vmax)
        BY_COPIES(1);
    else
        BY_COPIES(0);
}

// ``count`` rows of ``width`` elements gathered from a parameter's rows ``rows``; ``copy`` not the gradient
void adam_bf16_rows(int64_t count, int64_t width, const int64_t *restrict rows, int threads, int bf16_grad, ARRAYS,
                    SCALARS) {
#pragma omp parallel for schedule(static) num_threads(threads) if (count * width >= MIN_PARALLEL)
    for (int64_t r = 0; r < count; r++) {
        int64_t at = r * width, index = rows[r] * width;
        for (int64_t c = 0; c < width; c++) update(at + c, index + c, vmax != NULL, copy != NULL, bf16_grad, PASS);
    }
}
