/*
 * hello_colibri.c — Colibri from C, start to finish: read a packed checkpoint (*.colibri.safetensors),
 * create a context, run one forward on a few tokens, print some outputs and a checksum, destroy.
 *
 *   hello_colibri CHECKPOINT [--device cpu|cuda] [--tokens T] [--seed S] [--output FILE]
 *
 * The input is T rows of pseudo-random fp32 in [-1, 1) from --seed (splitmix64; tests/test_examples.py
 * makes the same numbers in Python). --output writes the output as raw little-endian fp32 [T, width].
 * Build: `make examples`, or see README "Using the C library" for the compiler line.
 */
#include <colibri.h>

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef HELLO_COLIBRI_CUDA  /* set by `make examples` when libcolibri has the CUDA backend */
#include <cuda_runtime.h>
#endif

#define MAX_HEADER_BYTES (100u * 1024u * 1024u) /* the Python reader's limit too */
#define MAX_DIMS 8
#define TEXT_CAP 128                            /* longest name or metadata value we keep */

/* ---------------------------------------------------------------------------------------------- */
/* Errors: every failure prints one line saying what and where, and main returns 1.               */

static char g_error[512];

static int fail(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    vsnprintf(g_error, sizeof g_error, format, args);
    va_end(args);
    return 0;
}

/* A failed library call: its status name and the library's message for this thread. */
static int fail_status(const char *what, colibri_status_t status)
{
    return fail("%s: %s: %s", what, colibri_status_string(status), colibri_last_error());
}

/* ---------------------------------------------------------------------------------------------- */
/* A small JSON reader, just enough for a safetensors header. It never reads past `end`; anything  */
/* it does not understand is refused rather than guessed at.                                      */

typedef struct {
    const char *start, *p, *end;
} json_t;

/* Is c one of the characters of set? (strchr alone would also find a NUL byte: the terminator) */
static int one_of(char c, const char *set)
{
    return c != '\0' && strchr(set, c) != NULL;
}

static void json_space(json_t *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static int json_char(json_t *j, char c)
{
    json_space(j);
    if (j->p >= j->end || *j->p != c)
        return fail("header: expected '%c' at byte %ld of the JSON", c, (long)(j->p - j->start));
    j->p++;
    return 1;
}

/* Is the next non-space character c? (consumes it if so) */
static int json_peek(json_t *j, char c)
{
    json_space(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

/* A string into buf (NUL-terminated, at most cap - 1 bytes), or skipped when buf is NULL.
 * Escapes are decoded; \u escapes outside ASCII become '?' (no name we look for has any). */
static int json_string(json_t *j, char *buf, size_t cap)
{
    size_t n = 0;
    if (!json_char(j, '"'))
        return 0;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if ((unsigned char)c < 0x20)
            return fail("header: control character inside a string");
        if (c == '\\') {
            if (j->p >= j->end)
                break;
            c = *j->p++;
            switch (c) {
            case '"': case '\\': case '/': break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u': {
                unsigned code = 0;
                int i;
                if (j->end - j->p < 4)
                    return fail("header: a \\u escape is cut short");
                for (i = 0; i < 4; i++) {
                    char h = *j->p++;
                    if (!isxdigit((unsigned char)h))
                        return fail("header: bad \\u escape");
                    code = code * 16 + (unsigned)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
                }
                c = code < 0x80 ? (char)code : '?';
                break;
            }
            default:
                return fail("header: unknown escape \\%c", c);
            }
        }
        if (buf) {
            if (n + 1 >= cap)
                return fail("header: a name or value longer than %d bytes", TEXT_CAP - 1);
            buf[n++] = c;
        }
    }
    if (j->p >= j->end)
        return fail("header: a string is not closed");
    j->p++; /* the closing quote */
    if (buf)
        buf[n] = '\0';
    return 1;
}

/* A non-negative integer that fits in 64 bits (no sign, fraction or exponent). */
static int json_uint(json_t *j, uint64_t *out)
{
    uint64_t value = 0;
    const char *start;
    json_space(j);
    start = j->p;
    while (j->p < j->end && isdigit((unsigned char)*j->p)) {
        unsigned digit = (unsigned)(*j->p++ - '0');
        if (value > (UINT64_MAX - digit) / 10)
            return fail("header: an integer too large for 64 bits");
        value = value * 10 + digit;
    }
    if (j->p == start || (j->p < j->end && one_of(*j->p, ".eE-+")))
        return fail("header: expected a non-negative integer");
    *out = value;
    return 1;
}

/* [a, b, ...] of non-negative integers, at most max of them. */
static int json_uint_list(json_t *j, uint64_t *values, int max, int *count)
{
    *count = 0;
    if (!json_char(j, '['))
        return 0;
    if (json_peek(j, ']'))
        return 1;
    do {
        if (*count == max)
            return fail("header: a list of more than %d integers", max);
        if (!json_uint(j, &values[(*count)++]))
            return 0;
    } while (json_peek(j, ','));
    return json_char(j, ']');
}

/* Skips any JSON value (for metadata we do not need), nesting at most 32 deep. */
static int json_skip(json_t *j, int depth)
{
    json_space(j);
    if (depth > 32)
        return fail("header: nested too deep");
    if (j->p >= j->end)
        return fail("header: ends where a value was expected");
    if (*j->p == '"')
        return json_string(j, NULL, 0);
    if (*j->p == '{' || *j->p == '[') {
        char close = *j->p == '{' ? '}' : ']';
        j->p++;
        if (json_peek(j, close))
            return 1;
        do {
            if (close == '}' && !(json_string(j, NULL, 0) && json_char(j, ':')))
                return 0;
            if (!json_skip(j, depth + 1))
                return 0;
        } while (json_peek(j, ','));
        return json_char(j, close);
    }
    if (!one_of(*j->p, "-0123456789tfn"))
        return fail("header: unexpected byte 0x%02x at byte %ld of the JSON", (unsigned char)*j->p, (long)(j->p - j->start));
    while (j->p < j->end && (isalnum((unsigned char)*j->p) || one_of(*j->p, "+-.")))
        j->p++; /* a number, true, false or null */
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* The checkpoint: which tensors, where, and the layer's settings (all strings in the metadata).  */

typedef struct {
    int present;
    char dtype[TEXT_CAP];
    uint64_t shape[MAX_DIMS];
    int ndim;
    uint64_t begin, end; /* byte offsets from the start of the data */
} tensor_t;

typedef struct {
    tensor_t experts, router, router_bias, expert_scales;
    char format[TEXT_CAP], expert_kind[TEXT_CAP], num_experts[TEXT_CAP], top_k[TEXT_CAP];
    char hidden_size[TEXT_CAP], intermediate_size[TEXT_CAP], routing[TEXT_CAP], renormalize[TEXT_CAP];
    char routed_scaling_factor[TEXT_CAP], n_group[TEXT_CAP], activation[TEXT_CAP];
    char scale_block_n[TEXT_CAP], scale_block_k[TEXT_CAP]; /* version 3, fp8 experts */
    char other_tensor[TEXT_CAP]; /* the first tensor this example cannot compute, if any */
} header_t;

static int parse_tensor(json_t *j, const char *name, tensor_t *t)
{
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    char key[TEXT_CAP];
    if (t->present)
        return fail("header: tensor '%s' appears twice", name);
    t->present = 1;
    if (!json_char(j, '{'))
        return 0;
    if (!json_peek(j, '}')) {
        do {
            uint64_t offsets[2];
            int count;
            if (!json_string(j, key, sizeof key) || !json_char(j, ':'))
                return 0;
            if (strcmp(key, "dtype") == 0) {
                if (!json_string(j, t->dtype, sizeof t->dtype))
                    return 0;
                have_dtype = 1;
            } else if (strcmp(key, "shape") == 0) {
                if (!json_uint_list(j, t->shape, MAX_DIMS, &t->ndim))
                    return 0;
                have_shape = 1;
            } else if (strcmp(key, "data_offsets") == 0) {
                if (!json_uint_list(j, offsets, 2, &count))
                    return 0;
                if (count != 2 || offsets[0] > offsets[1])
                    return fail("tensor '%s': data_offsets must be [begin, end] with begin <= end", name);
                t->begin = offsets[0];
                t->end = offsets[1];
                have_offsets = 1;
            } else {
                return fail("tensor '%s': unexpected field '%s'", name, key);
            }
        } while (json_peek(j, ','));
        if (!json_char(j, '}'))
            return 0;
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return fail("tensor '%s': needs dtype, shape and data_offsets", name);
    return 1;
}

static int parse_metadata(json_t *j, header_t *h)
{
    struct { const char *key; char *value; } wanted[] = {
        {"format", h->format}, {"expert_kind", h->expert_kind}, {"num_experts", h->num_experts},
        {"top_k", h->top_k}, {"hidden_size", h->hidden_size}, {"intermediate_size", h->intermediate_size},
        {"routing", h->routing}, {"renormalize", h->renormalize},
        {"routed_scaling_factor", h->routed_scaling_factor}, {"n_group", h->n_group}, {"activation", h->activation},
        {"scale_block_n", h->scale_block_n}, {"scale_block_k", h->scale_block_k},
    };
    char key[TEXT_CAP];
    size_t i;
    if (!json_char(j, '{'))
        return 0;
    if (json_peek(j, '}'))
        return 1;
    do {
        char *value = NULL;
        if (!json_string(j, key, sizeof key) || !json_char(j, ':'))
            return 0;
        for (i = 0; i < sizeof wanted / sizeof wanted[0]; i++)
            if (strcmp(key, wanted[i].key) == 0)
                value = wanted[i].value;
        if (!json_string(j, value, TEXT_CAP)) /* NULL: read and dropped; must be a string either way */
            return 0;
    } while (json_peek(j, ','));
    return json_char(j, '}');
}

static int parse_header(const char *text, size_t size, header_t *h)
{
    json_t j = {text, text, text + size};
    char name[TEXT_CAP];
    memset(h, 0, sizeof *h);
    if (!json_char(&j, '{'))
        return 0;
    if (!json_peek(&j, '}')) {
        do {
            int ok;
            if (!json_string(&j, name, sizeof name) || !json_char(&j, ':'))
                return 0;
            if (strcmp(name, "__metadata__") == 0)
                ok = parse_metadata(&j, h);
            else if (strcmp(name, "experts") == 0)
                ok = parse_tensor(&j, name, &h->experts);
            else if (strcmp(name, "router") == 0)
                ok = parse_tensor(&j, name, &h->router);
            else if (strcmp(name, "router_bias") == 0)
                ok = parse_tensor(&j, name, &h->router_bias);
            else if (strcmp(name, "expert_scales") == 0)
                ok = parse_tensor(&j, name, &h->expert_scales);
            else {
                /* expert biases, a shared expert, a router logit bias: noted, and refused below */
                if (!h->other_tensor[0])
                    snprintf(h->other_tensor, sizeof h->other_tensor, "%s", name);
                ok = json_skip(&j, 0);
            }
            if (!ok)
                return 0;
        } while (json_peek(&j, ','));
        if (!json_char(&j, '}'))
            return 0;
    }
    json_space(&j); /* the header may be padded with spaces */
    if (j.p != j.end)
        return fail("header: unexpected bytes after the JSON object");
    return 1;
}

/* A scale block (fp8): an integer in [0, 2^31), 0 meaning the whole dimension. */
static int setting_block(const char *key, const char *text, int32_t *out)
{
    char *rest;
    long value;
    if (!text[0])
        return fail("metadata: '%s' is missing (fp8 experts need their scale block)", key);
    value = strtol(text, &rest, 10);
    if (*rest || value < 0 || value > INT32_MAX)
        return fail("metadata: %s='%s' is not an integer >= 0", key, text);
    *out = (int32_t)value;
    return 1;
}

/* An integer setting in [1, 2^31). */
static int setting_int(const char *key, const char *text, int32_t *out)
{
    char *rest;
    long value;
    if (!text[0])
        return fail("metadata: '%s' is missing", key);
    value = strtol(text, &rest, 10);
    if (*rest || value < 1 || value > INT32_MAX)
        return fail("metadata: %s='%s' is not an integer >= 1", key, text);
    *out = (int32_t)value;
    return 1;
}

static size_t dtype_bytes(const char *dtype)
{
    if (strcmp(dtype, "F32") == 0)
        return 4;
    if (strcmp(dtype, "F16") == 0 || strcmp(dtype, "BF16") == 0)
        return 2;
    if (strcmp(dtype, "F8_E4M3") == 0)
        return 1;
    return 0;
}

/* Checks that tensor `t` has the expected dtype (NULL: F32, F16, BF16 or F8_E4M3) and shape, and that its
 * bytes lie inside the file's data. */
static int check_tensor(const char *name, const tensor_t *t, const char *dtype, int ndim,
                        const uint64_t *shape, uint64_t data_bytes)
{
    size_t elem = dtype_bytes(t->dtype);
    uint64_t numel = 1;
    int d;
    if (elem == 0 || (dtype && strcmp(t->dtype, dtype) != 0))
        return fail("tensor '%s': dtype %s, expected %s", name, t->dtype, dtype ? dtype : "F32, F16, BF16 or F8_E4M3");
    if (t->ndim != ndim)
        return fail("tensor '%s': %d dimensions, expected %d", name, t->ndim, ndim);
    for (d = 0; d < ndim; d++) {
        if (t->shape[d] != shape[d])
            return fail("tensor '%s': dimension %d is %llu, expected %llu", name, d,
                        (unsigned long long)t->shape[d], (unsigned long long)shape[d]);
        numel *= shape[d]; /* the expected shape comes from int32 settings: no overflow below 2^62 */
    }
    if (t->end - t->begin != numel * elem)
        return fail("tensor '%s': %llu bytes for its shape, expected %llu", name,
                    (unsigned long long)(t->end - t->begin), (unsigned long long)(numel * elem));
    if (t->end > data_bytes)
        return fail("tensor '%s': data ends at byte %llu but the file holds only %llu data bytes (truncated?)",
                    name, (unsigned long long)t->end, (unsigned long long)data_bytes);
    return 1;
}

/* Reads a tensor's bytes into a new buffer (freed by the caller). */
static void *read_tensor(FILE *file, uint64_t data_start, const tensor_t *t, const char *name)
{
    uint64_t offset = data_start + t->begin, size = t->end - t->begin;
    void *buffer;
    if (offset > (uint64_t)LONG_MAX || size > (uint64_t)SIZE_MAX) {
        fail("tensor '%s': too far into the file for fseek", name);
        return NULL;
    }
    buffer = malloc(size ? (size_t)size : 1);
    if (!buffer) {
        fail("tensor '%s': out of memory for %llu bytes", name, (unsigned long long)size);
        return NULL;
    }
    if (fseek(file, (long)offset, SEEK_SET) != 0 || fread(buffer, 1, (size_t)size, file) != (size_t)size) {
        free(buffer);
        fail("tensor '%s': could not read %llu bytes", name, (unsigned long long)size);
        return NULL;
    }
    return buffer;
}

typedef struct {
    colibri_moe_config_t config;
    void *experts;      /* [E, expert numel] in config.weight_dtype */
    float *router;      /* [E, H] */
    float *router_bias; /* [E] or NULL */
    float *scales;      /* fp8 experts: [E, colibri_scales_numel] scale grids, else NULL */
    uint64_t experts_numel;
} checkpoint_t;

static void checkpoint_free(checkpoint_t *c)
{
    free(c->experts);
    free(c->router);
    free(c->router_bias);
    free(c->scales);
    memset(c, 0, sizeof *c);
}

static int checkpoint_read_file(FILE *file, checkpoint_t *c)
{
    unsigned char len_bytes[8];
    uint64_t header_len = 0, file_size, expert_numel;
    long end;
    char *text;
    header_t h;
    int i, ok;
    colibri_moe_config_t *cfg = &c->config;

    if (fseek(file, 0, SEEK_END) != 0 || (end = ftell(file)) < 0 || fseek(file, 0, SEEK_SET) != 0)
        return fail("cannot find the file's size");
    file_size = (uint64_t)end;
    if (file_size < 8 || fread(len_bytes, 1, 8, file) != 8)
        return fail("too short for a safetensors file (%llu bytes)", (unsigned long long)file_size);
    for (i = 7; i >= 0; i--)
        header_len = header_len << 8 | len_bytes[i]; /* little-endian */
    if (header_len > MAX_HEADER_BYTES || header_len > file_size - 8)
        return fail("header length %llu does not fit a file of %llu bytes (truncated, or not safetensors)",
                    (unsigned long long)header_len, (unsigned long long)file_size);
    text = malloc((size_t)header_len + 1);
    if (!text)
        return fail("out of memory for the header");
    ok = fread(text, 1, (size_t)header_len, file) == (size_t)header_len;
    ok = ok ? parse_header(text, (size_t)header_len, &h) : fail("could not read the header");
    free(text);
    if (!ok)
        return 0;

    /* The layer's settings, as the Python reader (backend_src/colibri/checkpoint.py) takes them. */
    if (strcmp(h.format, "colibri-moe/1") != 0 && strcmp(h.format, "colibri-moe/2") != 0 &&
        strcmp(h.format, "colibri-moe/3") != 0)
        return fail("metadata format is '%s', expected 'colibri-moe/1', '/2' or '/3' (pack a Hugging Face "
                    "checkpoint with `python -m colibri pack`)", h.format);
    /* This example has no group-limited routing or other activations (colibri_moe_context_create has). */
    if ((h.n_group[0] && strcmp(h.n_group, "1") != 0) || (h.activation[0] && strcmp(h.activation, "silu") != 0))
        return fail("metadata n_group='%s' activation='%s': this example has no group-limited routing and "
                    "SiLU experts only", h.n_group, h.activation);
    memset(cfg, 0, sizeof *cfg);
    if (!setting_int("num_experts", h.num_experts, &cfg->num_experts) ||
        !setting_int("top_k", h.top_k, &cfg->top_k) ||
        !setting_int("hidden_size", h.hidden_size, &cfg->hidden_size) ||
        !setting_int("intermediate_size", h.intermediate_size, &cfg->intermediate_size))
        return 0;
    if (strcmp(h.expert_kind, "swiglu") == 0)
        cfg->expert_kind = COLIBRI_EXPERT_SWIGLU;
    else if (strcmp(h.expert_kind, "linear") == 0)
        cfg->expert_kind = COLIBRI_EXPERT_LINEAR;
    else
        return fail("metadata: expert_kind='%s' is not swiglu or linear", h.expert_kind);
    if (strcmp(h.routing, "softmax_topk") == 0)
        cfg->routing = COLIBRI_ROUTING_SOFTMAX_TOPK;
    else if (strcmp(h.routing, "topk_softmax") == 0)
        cfg->routing = COLIBRI_ROUTING_TOPK_SOFTMAX;
    else if (strcmp(h.routing, "sigmoid_bias") == 0)
        cfg->routing = COLIBRI_ROUTING_SIGMOID_BIAS;
    else
        return fail("metadata: routing='%s' is not softmax_topk, topk_softmax or sigmoid_bias", h.routing);
    /* colibri_moe_context_init uses router_bias for sigmoid_bias routing only; from version 2 on it
     * corrects the selection under any routing. */
    if (strcmp(h.format, "colibri-moe/1") != 0 && h.router_bias.present && cfg->routing != COLIBRI_ROUTING_SIGMOID_BIAS)
        return fail("tensor 'router_bias' with routing '%s': this example uses it with sigmoid_bias only", h.routing);
    if (strcmp(h.renormalize, "true") == 0 || strcmp(h.renormalize, "1") == 0)
        cfg->renormalize = 1;
    else if (strcmp(h.renormalize, "false") != 0 && strcmp(h.renormalize, "0") != 0)
        return fail("metadata: renormalize='%s' is not true or false", h.renormalize);
    cfg->routed_scaling_factor = 1.0f;
    if (h.routed_scaling_factor[0]) {
        char *rest;
        cfg->routed_scaling_factor = strtof(h.routed_scaling_factor, &rest);
        if (*rest)
            return fail("metadata: routed_scaling_factor='%s' is not a number", h.routed_scaling_factor);
    }

    /* The tensors: shapes from the settings, every byte range inside the file. */
    expert_numel = colibri_expert_numel(cfg->expert_kind, cfg->hidden_size, cfg->intermediate_size);
    if (!h.experts.present)
        return fail("no 'experts' tensor");
    if (strcmp(h.experts.dtype, "F8_E4M3") == 0 && !h.expert_scales.present)
        return fail("fp8 experts without an 'expert_scales' tensor");
    if (!h.router.present)
        return fail("no 'router' tensor: this example routes with the checkpoint's router (without one, "
                    "pass topk_ids and topk_weights to colibri_moe_forward)");
    /* This example computes routed experts only; any other tensor would be silently dropped. */
    if (h.other_tensor[0])
        return fail("tensor '%s': this example computes routed experts only (no biases, no shared expert); "
                    "serve this layer with the Python package", h.other_tensor);
    {
        const uint64_t data_bytes = file_size - 8 - header_len;
        const uint64_t experts_shape[2] = {(uint64_t)cfg->num_experts, expert_numel};
        const uint64_t router_shape[2] = {(uint64_t)cfg->num_experts, (uint64_t)cfg->hidden_size};
        if (!check_tensor("experts", &h.experts, NULL, 2, experts_shape, data_bytes) ||
            !check_tensor("router", &h.router, "F32", 2, router_shape, data_bytes) ||
            (h.router_bias.present && !check_tensor("router_bias", &h.router_bias, "F32", 1, router_shape, data_bytes)))
            return 0;
        cfg->weight_dtype = strcmp(h.experts.dtype, "F32") == 0   ? COLIBRI_DTYPE_F32
                          : strcmp(h.experts.dtype, "F16") == 0   ? COLIBRI_DTYPE_F16
                          : strcmp(h.experts.dtype, "BF16") == 0  ? COLIBRI_DTYPE_BF16
                                                                  : COLIBRI_DTYPE_F8E4M3;
        /* fp8 experts come with their scale grids (colibri.h): dequantised weight = code value * scale */
        if (cfg->weight_dtype == COLIBRI_DTYPE_F8E4M3) {
            uint64_t scales_shape[2] = {(uint64_t)cfg->num_experts, 0};
            if (!setting_block("scale_block_n", h.scale_block_n, &cfg->scale_block_n) ||
                !setting_block("scale_block_k", h.scale_block_k, &cfg->scale_block_k))
                return 0;
            scales_shape[1] = colibri_scales_numel(cfg->expert_kind, cfg->hidden_size, cfg->intermediate_size,
                                                   cfg->scale_block_n, cfg->scale_block_k);
            if (!check_tensor("expert_scales", &h.expert_scales, "F32", 2, scales_shape, data_bytes))
                return 0;
            c->scales = read_tensor(file, 8 + header_len, &h.expert_scales, "expert_scales");
            if (!c->scales)
                return 0;
        } else if (h.expert_scales.present) {
            return fail("tensor 'expert_scales' beside %s experts: scales belong to fp8 experts", h.experts.dtype);
        }
        c->experts_numel = (uint64_t)cfg->num_experts * expert_numel;
        c->experts = read_tensor(file, 8 + header_len, &h.experts, "experts");
        c->router = read_tensor(file, 8 + header_len, &h.router, "router");
        if (h.router_bias.present)
            c->router_bias = read_tensor(file, 8 + header_len, &h.router_bias, "router_bias");
        if (!c->experts || !c->router || (h.router_bias.present && !c->router_bias))
            return 0;
    }
    return 1;
}

/* Reads and checks a packed checkpoint into c (weights on the host). On failure, g_error says why. */
static int checkpoint_read(const char *path, checkpoint_t *c)
{
    FILE *file = fopen(path, "rb");
    int ok;
    memset(c, 0, sizeof *c);
    if (!file)
        return fail("cannot open it (no such file, or not readable)");
    ok = checkpoint_read_file(file, c);
    fclose(file);
    if (!ok)
        checkpoint_free(c);
    return ok;
}

/* ---------------------------------------------------------------------------------------------- */
/* The forward: on the CPU the library reads and writes host memory; on CUDA, device memory.      */

static int forward(colibri_moe_context_t *ctx, colibri_device_t device, int64_t tokens, const float *input,
                   size_t in_bytes, float *output, size_t out_bytes)
{
    colibri_status_t status;
    if (device == COLIBRI_DEVICE_CPU) {
        status = colibri_moe_forward(ctx, tokens, COLIBRI_DTYPE_F32, input, NULL, NULL, output, NULL);
        return status == COLIBRI_OK ? 1 : fail_status("colibri_moe_forward", status);
    }
#ifdef HELLO_COLIBRI_CUDA
    {
        void *d_in = NULL, *d_out = NULL;
        cudaError_t err = cudaMalloc(&d_in, in_bytes);
        int ok = 0;
        if (err == cudaSuccess)
            err = cudaMalloc(&d_out, out_bytes);
        if (err == cudaSuccess)
            err = cudaMemcpy(d_in, input, in_bytes, cudaMemcpyHostToDevice);
        if (err != cudaSuccess) {
            fail("CUDA: %s", cudaGetErrorString(err));
        } else {
            /* Enqueued on the legacy default stream (NULL); the copy back waits for it. */
            status = colibri_moe_forward(ctx, tokens, COLIBRI_DTYPE_F32, d_in, NULL, NULL, d_out, NULL);
            if (status != COLIBRI_OK)
                fail_status("colibri_moe_forward", status);
            else if ((err = cudaMemcpy(output, d_out, out_bytes, cudaMemcpyDeviceToHost)) != cudaSuccess)
                fail("CUDA: copying the output back: %s", cudaGetErrorString(err));
            else if ((status = colibri_moe_context_take_device_error(ctx)) != COLIBRI_OK)
                fail_status("colibri_moe_context_take_device_error", status);
            else
                ok = 1;
        }
        cudaFree(d_in);
        cudaFree(d_out);
        return ok;
    }
#else
    (void)in_bytes;
    (void)out_bytes;
    return fail("--device cuda: this hello_colibri was compiled without the CUDA runtime; `make examples` "
                "on a build with CUDA compiles it with -DHELLO_COLIBRI_CUDA");
#endif
}

/* splitmix64: the same numbers in any language, so a test can rebuild the input exactly. */
static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void usage(void)
{
    fprintf(stderr, "usage: hello_colibri CHECKPOINT [--device cpu|cuda] [--tokens T] [--seed S] [--output FILE]\n");
}

int main(int argc, char **argv)
{
    const char *path = NULL, *device_name = "cpu", *output_path = NULL;
    long tokens = 4;
    uint64_t seed = 0, rng;
    checkpoint_t ckpt;
    colibri_moe_context_t *ctx = NULL;
    colibri_status_t status;
    float *input = NULL, *output = NULL;
    int64_t i, width;
    double sum = 0.0, sum_abs = 0.0;
    int ok = 0, a;

    for (a = 1; a < argc; a++) {
        const char *arg = argv[a], *value = a + 1 < argc ? argv[a + 1] : NULL;
        char *rest = NULL;
        if (strcmp(arg, "--device") == 0 && value) {
            device_name = value;
        } else if (strcmp(arg, "--tokens") == 0 && value) {
            tokens = strtol(value, &rest, 10);
            if (*rest || tokens < 1 || tokens > 1000000) {
                fprintf(stderr, "hello_colibri: --tokens %s: expected an integer in [1, 1000000]\n", value);
                return 2;
            }
        } else if (strcmp(arg, "--seed") == 0 && value) {
            seed = strtoull(value, &rest, 10);
            if (*rest || !*value) {
                fprintf(stderr, "hello_colibri: --seed %s: expected a non-negative integer\n", value);
                return 2;
            }
        } else if (strcmp(arg, "--output") == 0 && value) {
            output_path = value;
        } else if (arg[0] != '-' && !path) {
            path = arg;
            continue;
        } else {
            usage();
            return 2;
        }
        a++; /* the option's value */
    }
    if (!path || (strcmp(device_name, "cpu") != 0 && strcmp(device_name, "cuda") != 0)) {
        usage();
        return 2;
    }

    printf("colibri %s (CUDA backend %s, %d CUDA device(s))\n", colibri_version(),
           colibri_cuda_built() ? "built" : "not built", (int)colibri_cuda_device_count());

    /* 1. The checkpoint, read into host memory. */
    if (!checkpoint_read(path, &ckpt)) {
        fprintf(stderr, "hello_colibri: %s: %s\n", path, g_error);
        return 1;
    }
    printf("%s: %s experts, E=%d k=%d H=%d F=%d, %s weights\n", path,
           ckpt.config.expert_kind == COLIBRI_EXPERT_SWIGLU ? "swiglu" : "linear", (int)ckpt.config.num_experts,
           (int)ckpt.config.top_k, (int)ckpt.config.hidden_size, (int)ckpt.config.intermediate_size,
           ckpt.config.weight_dtype == COLIBRI_DTYPE_F32 ? "fp32" :
           ckpt.config.weight_dtype == COLIBRI_DTYPE_F16 ? "fp16" :
           ckpt.config.weight_dtype == COLIBRI_DTYPE_BF16 ? "bf16" : "fp8 e4m3");

    /* 2. The device. A CUDA library still runs on the CPU; a CPU-only one says so for --device cuda. */
    ckpt.config.device = COLIBRI_DEVICE_CPU;
    if (strcmp(device_name, "cuda") == 0) {
        if (!colibri_cuda_built()) {
            fail("--device cuda: libcolibri was built without the CUDA backend (no nvcc, or CUDA=0): "
                 "use --device cpu, or rebuild with nvcc on PATH");
            goto done;
        }
        if (colibri_cuda_device_count() < 1) {
            fail("--device cuda: no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
            goto done;
        }
        ckpt.config.device = COLIBRI_DEVICE_CUDA;
        ckpt.config.device_id = 0;
    }

    /* 3. The context. Expert e starts at element e * (elements per expert) of the packed buffer.
     *    On the CPU it borrows the weights (freed only after destroy); on CUDA it copies them. */
    {
        const int32_t E = ckpt.config.num_experts;
        const uint64_t per_expert = ckpt.experts_numel / (uint64_t)E;
        uint64_t *offsets = malloc((size_t)E * sizeof *offsets);
        if (!offsets) {
            fail("out of memory");
            goto done;
        }
        for (a = 0; a < E; a++)
            offsets[a] = (uint64_t)a * per_expert;
        if (ckpt.scales) { /* fp8: only colibri_moe_context_create takes the scale grids */
            colibri_moe_weights_t weights;
            memset(&weights, 0, sizeof weights);
            weights.expert_weights = ckpt.experts;
            weights.expert_offsets = offsets;
            weights.expert_weights_numel = ckpt.experts_numel;
            weights.router_weight = ckpt.router;
            weights.router_bias = ckpt.router_bias;
            weights.expert_scales = ckpt.scales;
            status = colibri_moe_context_create(&ctx, &ckpt.config, &weights);
        } else {
            status = colibri_moe_context_init(&ctx, &ckpt.config, ckpt.experts, offsets, ckpt.experts_numel,
                                              ckpt.router, ckpt.router_bias);
        }
        free(offsets); /* read during init only */
        if (status != COLIBRI_OK) {
            fail_status(ckpt.scales ? "colibri_moe_context_create" : "colibri_moe_context_init", status);
            goto done;
        }
    }

    /* 4. One forward on `tokens` rows of pseudo-random input. */
    width = ckpt.config.expert_kind == COLIBRI_EXPERT_SWIGLU ? ckpt.config.hidden_size : ckpt.config.intermediate_size;
    input = malloc((size_t)tokens * (size_t)ckpt.config.hidden_size * sizeof *input);
    output = malloc((size_t)tokens * (size_t)width * sizeof *output);
    if (!input || !output) {
        fail("out of memory for %ld tokens", tokens);
        goto done;
    }
    rng = seed;
    for (i = 0; i < tokens * ckpt.config.hidden_size; i++) /* 24 random bits: exact in fp32, in [-1, 1) */
        input[i] = (float)(splitmix64(&rng) >> 40) / 8388608.0f - 1.0f;
    if (!forward(ctx, ckpt.config.device, tokens, input, (size_t)tokens * ckpt.config.hidden_size * sizeof *input,
                 output, (size_t)(tokens * width) * sizeof *output))
        goto done;

    /* 5. A few values and a checksum. */
    printf("forward: %ld token(s) on %s, seed %llu, output [%ld, %ld] fp32\n", tokens, device_name,
           (unsigned long long)seed, tokens, (long)width);
    for (i = 0; i < tokens * width; i++) {
        sum += output[i];
        sum_abs += fabs(output[i]);
    }
    printf("output[0][0:4] = %.6f %.6f %.6f %.6f\n", output[0], output[width > 1 ? 1 : 0],
           output[width > 2 ? 2 : 0], output[width > 3 ? 3 : 0]);
    printf("checksum: sum %.9g, sum of |x| %.9g\n", sum, sum_abs);
    if (output_path) {
        FILE *out = fopen(output_path, "wb");
        size_t n = (size_t)(tokens * width);
        int written = out && fwrite(output, sizeof *output, n, out) == n;
        if ((out && fclose(out) != 0) || !written) {
            fail("--output %s: could not write it", output_path);
            goto done;
        }
    }
    ok = 1;

done:
    colibri_moe_context_destroy(ctx); /* NULL is fine */
    checkpoint_free(&ckpt);
    free(input);
    free(output);
    if (!ok) {
        fprintf(stderr, "hello_colibri: %s\n", g_error);
        return 1;
    }
    return 0;
}
