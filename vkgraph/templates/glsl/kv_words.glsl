// The paged K/V cache's 16-byte words, as both attention cores (attention_common.glsl, decode_lanes.glsl) read
// them: KV_PER_WORD values a word (float16 with -DKV_F16, else float32), WORDS_PER_TOKEN words a token of HEAD_SIZE.
#ifdef KV_F16
#define KV_PER_WORD 8
#else
#define KV_PER_WORD 4
#endif
#define WORDS_PER_TOKEN (HEAD_SIZE / KV_PER_WORD)
