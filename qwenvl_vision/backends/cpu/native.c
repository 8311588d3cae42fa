/* The CPU backend's fused elementwise steps (native.py builds them for the CPU at hand, -march=native): each one
   pass over its rows, as the reference's ops in its order and roundings (fp32 math rounded to the dtype where it
   rounds; no FMA contraction). Rope and the residual add give its bits; the norms and activations are within a few
   fp32 ulps (the sums' order, LayerNorm's (x - mean) * rstd form, libmvec's expf; GELU-tanh's tail nearer the exact
   value). Rows are split over `threads` OpenMP threads (the libgomp.so.1 torch loaded, where its build ships that
   one); every matrix is rows of a leading dimension. */
#include <math.h>
#include <stdint.h>

extern float expf(float) __attribute__((simd("notinbranch")));  /* vectorized by glibc's libmvec */

static inline float bf16_float(uint16_t v) { union { uint32_t u; float f; } c = {(uint32_t)v << 16}; return c.f; }
static inline uint16_t float_bf16(float f) {  /* round to nearest even, as c10::BFloat16 */
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
#define SAME(v) (v)

#define LANES 16  /* independent partial sums: a vectorizable sum of squares without reassociation */

#define KERNELS(T, NAME, LOAD, STORE)                                                                             \
/* x += update (if given), then (if out is given) RMSNorm's out = weight * dtype(x * rsqrt(mean(x^2) + eps)), or  \
   LayerNorm's out = dtype((x - mean) * rsqrt(var + eps) * weight + bias) (bias may be NULL). */                  \
void add_norm_##NAME(T *x, const T *update, const T *weight, const T *bias, T *out, long rows, long dim,          \
                     long ldx, long ldu, long ldo, float eps, int rms, int threads) {                             \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long r = 0; r < rows; r++) {                                                                             \
        T *xr = x + r * ldx;                                                                                      \
        if (update)                                                                                               \
            for (long j = 0; j < dim; j++) xr[j] = STORE(LOAD(xr[j]) + LOAD(update[r * ldu + j]));                \
        if (!out) continue;                                                                                       \
        float mean = 0, sum = 0, partial[LANES] = {0};                                                            \
        long j = 0;                                                                                               \
        if (!rms) { /* the mean first: LayerNorm's variance is of x - mean */                                     \
            for (; j + LANES <= dim; j += LANES)                                                                  \
                for (int l = 0; l < LANES; l++) partial[l] += LOAD(xr[j + l]);                                    \
            for (int l = 0; l < LANES; l++) { mean += partial[l]; partial[l] = 0; }                               \
            for (; j < dim; j++) mean += LOAD(xr[j]);                                                             \
            mean /= (float)dim;                                                                                   \
        }                                                                                                         \
        for (j = 0; j + LANES <= dim; j += LANES)                                                                 \
            for (int l = 0; l < LANES; l++) partial[l] += (LOAD(xr[j + l]) - mean) * (LOAD(xr[j + l]) - mean);    \
        for (int l = 0; l < LANES; l++) sum += partial[l];                                                        \
        for (; j < dim; j++) sum += (LOAD(xr[j]) - mean) * (LOAD(xr[j]) - mean);                                  \
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);                                                       \
        T *o = out + r * ldo;  /* a loop per norm, no test per element: in bf16 both vectorize only so */         \
        for (j = 0; rms && j < dim; j++) o[j] = STORE(LOAD(weight[j]) * LOAD(STORE(LOAD(xr[j]) * scale)));        \
        for (j = 0; !rms && j < dim; j++)  /* adding -0 where there is no bias changes no value */                \
            o[j] = STORE((LOAD(xr[j]) - mean) * scale * LOAD(weight[j]) + (bias ? LOAD(bias[j]) : -0.0f));        \
    }                                                                                                             \
}                                                                                                                 \
                                                                                                                  \
/* `heads` heads of head_dim per row rotated, out = dtype(x * cos + rotate_half(x) * sin) (cos, sin: fp32 rows x  \
   head_dim; x1 * cos - x2 * sin is x1 * cos + (-x2) * sin bit for bit), the `tail` copied. out may be x. */      \
void rope_##NAME(const T *x, T *out, const float *cos, const float *sin, long rows, long heads,                   \
                 long head_dim, long tail, long ldx, long ldo, int threads) {                                     \
    long half = head_dim / 2;                                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long r = 0; r < rows; r++) {                                                                             \
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;                                             \
        float rotated[head_dim];                                                                                  \
        for (long h = 0; h < heads; h++) {                                                                        \
            const T *xh = x + r * ldx + h * head_dim;                                                             \
            for (long d = 0; d < half; d++) rotated[d] = LOAD(xh[d]) * c[d] - LOAD(xh[d + half]) * s[d];          \
            for (long d = half; d < head_dim; d++) rotated[d] = LOAD(xh[d]) * c[d] + LOAD(xh[d - half]) * s[d];   \
            for (long d = 0; d < head_dim; d++) out[r * ldo + h * head_dim + d] = STORE(rotated[d]);              \
        }                                                                                                         \
        if (out != x)                                                                                             \
            for (long j = heads * head_dim; j < heads * head_dim + tail; j++) out[r * ldo + j] = x[r * ldx + j];  \
    }                                                                                                             \
}                                                                                                                 \
                                                                                                                  \
/* gated: out = dtype(dtype(silu(gate)) * up) of rows [gate | up], each `width` wide; else out = gelu_tanh(x) =   \
   dtype(0.5 * x * (1 + tanh(u))), u = sqrt(2 / pi) * (x + 0.044715 * x^3), as the equal x / (1 + exp(-2u)): a    \
   few fp32 ulps from torch's for x >= -2, nearer the exact value below (where torch's 1 + tanh cancels). */      \
void activation_##NAME(const T *x, T *out, long rows, long width, long ldx, long ldo, int gated, int threads) {   \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long r = 0; r < rows; r++) {                                                                             \
        const T *xr = x + r * ldx, *up = xr + width;                                                              \
        T *o = out + r * ldo;                                                                                     \
        if (gated) {                                                                                              \
            _Pragma("omp simd")                                                                                   \
            for (long j = 0; j < width; j++)                                                                      \
                o[j] = STORE(LOAD(STORE(LOAD(xr[j]) / (1.0f + expf(-LOAD(xr[j]))))) * LOAD(up[j]));               \
        } else {                                                                                                  \
            _Pragma("omp simd")                                                                                   \
            for (long j = 0; j < width; j++) {                                                                    \
                float v = LOAD(xr[j]), u = 0.7978845608028654f * (v + 0.044715f * (v * v * v));                   \
                o[j] = STORE(v / (1.0f + expf(-2.0f * u)));                                                       \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

KERNELS(uint16_t, bf16, bf16_float, float_bf16)
KERNELS(float, f32, SAME, SAME)
