// ../scale.cpp compiled again for x86-64-v3 (AVX2), into namespace ddpcomm::avx2; dispatch.cpp
// registers these kernels where the CPU has it. See ../dispatch.h.
#define DDPCOMM_ISA_AVX2
#include "../scale.cpp"
