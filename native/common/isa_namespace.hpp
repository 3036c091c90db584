// Header code compiled into several translation units with different instruction-set
// flags must not share out-of-line copies: the linker keeps one copy of an inline function
// (a weak symbol) for the whole library, and an AVX-512 copy chosen for baseline code
// would fault on a smaller CPU. Each ISA translation unit is compiled with
// -DNUMA_MOE_ISA_NS=<its name> (native/kernels/sources.cmake), and shared headers put their
// inline functions in that inline namespace, so every ISA's copies have names of their own
// whatever the link order. tests/test_native_build.py checks the built objects.
#pragma once

#ifndef NUMA_MOE_ISA_NS
#define NUMA_MOE_ISA_NS baseline
#endif
