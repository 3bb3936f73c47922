// The gated unit's activation of four gate values, shared by every kernel that computes act(gate) * up (glu_q8.comp,
// the matvec's -DGLU_Q8 epilogue), so they round alike: SiLU, g / (1 + exp(-g)), or with -DGELU_TANH the tanh GELU,
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
vec4 glu_act(vec4 g) {
#ifdef GELU_TANH
    const vec4 z = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    return 0.5 * g * (1.0 + (1.0 - 2.0 / (exp(2.0 * z) + 1.0)));  // tanh without inf / inf at large |z|
#else
    return g / (1.0 + exp(-g));
#endif
}
