// Argument checks: NUMA_MOE_CHECK(cond, part, part, ...) throws std::invalid_argument
// (pybind11 raises it as ValueError) with the parts streamed into one message when cond is
// false; fail(part, ...) throws it unconditionally. One way to build every argument error, so
// a message reads as the code that writes it:
//     NUMA_MOE_CHECK(a.ndim() == ndim, name, ": expected ", ndim, "-D array, got shape ", shape_text(a));
// Integers stream as std::to_string writes them; a double streams with six significant
// digits, so pass std::to_string(value) where a message wants fixed notation.
// Baseline code only: ISA translation units must not instantiate std:: templates.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace numa_moe {

template <typename... Parts>
std::string message(const Parts&... parts) {
    std::ostringstream text;
    (text << ... << parts);
    return text.str();
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    throw std::invalid_argument(message(parts...));
}

}  // namespace numa_moe

#define NUMA_MOE_CHECK(cond, ...)                                \
    do {                                                         \
        if (!(cond)) ::numa_moe::fail(__VA_ARGS__);              \
    } while (0)
