// Linux placement syscalls. Layouts: node masks are arrays of unsigned long, bit n of
// word n / 64 = node n (the kernel's nodemask ABI); page lists are arrays of page-aligned
// addresses, one per base page; status arrays are int per page (node id or -errno).
#include "placement/syscalls.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <system_error>
#include <thread>
#include <unistd.h>

namespace numa_moe::placement {

namespace {
constexpr std::size_t kMaskWords = kMaxNodes / (8 * sizeof(unsigned long));

std::size_t round_up(std::size_t value, std::size_t multiple) {
    return (value + multiple - 1) / multiple * multiple;
}
}  // namespace

SyscallError::SyscallError(std::string call, int error_number, const std::string& detail)
    : std::runtime_error(call + ": " + detail + " (" + std::strerror(error_number) + ")"),
      call_(std::move(call)),
      errno_(error_number) {}

std::size_t base_page_bytes() {
    static const std::size_t bytes = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return bytes;
}

NodeMask make_node_mask(const std::vector<int>& nodes) {
    NodeMask mask;
    mask.words.assign(kMaskWords, 0UL);
    constexpr int bits = 8 * sizeof(unsigned long);
    for (int node : nodes) {
        if (node < 0 || node >= kMaxNodes) {
            throw SyscallError("mbind", EINVAL, "node " + std::to_string(node) +
                                                    " is outside 0.." + std::to_string(kMaxNodes - 1));
        }
        mask.words[node / bits] |= 1UL << (node % bits);
    }
    return mask;
}

std::vector<int> node_mask_to_list(const NodeMask& mask) {
    std::vector<int> nodes;
    constexpr int bits = 8 * sizeof(unsigned long);
    for (std::size_t w = 0; w < mask.words.size(); ++w) {
        for (int b = 0; b < bits; ++b) {
            if (mask.words[w] & (1UL << b)) nodes.push_back(static_cast<int>(w) * bits + b);
        }
    }
    return nodes;
}

void mbind_range(void* address, std::size_t length, int mode, const std::vector<int>& nodes) {
    NodeMask mask = make_node_mask(nodes);
    if (syscall(SYS_mbind, address, length, mode, mask.words.data(), mask.maxnode(), 0U) != 0) {
        const int err = errno;
        std::string list;
        for (int n : nodes) list += (list.empty() ? "" : ",") + std::to_string(n);
        throw SyscallError("mbind", err, "mode " + std::to_string(mode) + " over nodes [" + list + "]");
    }
}

void madvise_range(void* address, std::size_t length, int advice, const char* advice_name) {
    if (madvise(address, length, advice) != 0) {
        throw SyscallError("madvise", errno, advice_name);
    }
}

MemPolicy get_mempolicy_of(const void* address) {
    NodeMask mask;
    mask.words.assign(kMaskWords, 0UL);
    int mode = 0;
    const unsigned long flags = address ? kMpolFAddr : 0;
    if (syscall(SYS_get_mempolicy, &mode, mask.words.data(), mask.maxnode(), address, flags) != 0) {
        throw SyscallError("get_mempolicy", errno, address ? "policy of an address" : "thread policy");
    }
    MemPolicy policy;
    policy.mode = mode & 0xff;  // the high bits carry MPOL_F_STATIC_NODES and friends
    policy.nodes = node_mask_to_list(mask);
    return policy;
}

std::vector<int> mems_allowed() {
    NodeMask mask;
    mask.words.assign(kMaskWords, 0UL);
    int mode = 0;
    if (syscall(SYS_get_mempolicy, &mode, mask.words.data(), mask.maxnode(), nullptr,
                static_cast<unsigned long>(kMpolFMemsAllowed)) != 0) {
        throw SyscallError("get_mempolicy", errno, "MPOL_F_MEMS_ALLOWED");
    }
    return node_mask_to_list(mask);
}

void query_resident_pages(const void* address, std::size_t length, unsigned char* resident_out) {
    if (length == 0) return;
    if (::mincore(const_cast<void*>(address), length, resident_out) != 0) {
        throw SyscallError("mincore", errno, "");
    }
    const std::size_t pages = (length + base_page_bytes() - 1) / base_page_bytes();
    for (std::size_t i = 0; i < pages; ++i) resident_out[i] &= 1;
}

void query_page_nodes(const std::uintptr_t* pages, std::size_t count, int* status_out) {
    if (count == 0) return;
    if (syscall(SYS_move_pages, 0, count, pages, nullptr, status_out, 0) < 0) {
        throw SyscallError("move_pages", errno, "query of " + std::to_string(count) + " pages");
    }
}

long move_pages_to(const std::uintptr_t* pages, const int* target_nodes, std::size_t count,
                   int* status_out) {
    if (count == 0) return 0;
    const long rc = syscall(SYS_move_pages, 0, count, pages, target_nodes, status_out, kMpolMfMove);
    if (rc < 0) {
        throw SyscallError("move_pages", errno, "move of " + std::to_string(count) + " pages");
    }
    return rc;
}

std::vector<int> get_affinity(int pid) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(pid, sizeof(set), &set) != 0) {
        throw SyscallError("sched_getaffinity", errno, "pid " + std::to_string(pid));
    }
    std::vector<int> cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
    return cpus;
}

void set_affinity(int pid, const std::vector<int>& cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) {
        if (cpu < 0 || cpu >= CPU_SETSIZE) {
            throw SyscallError("sched_setaffinity", EINVAL, "cpu " + std::to_string(cpu) + " out of range");
        }
        CPU_SET(cpu, &set);
    }
    if (sched_setaffinity(pid, sizeof(set), &set) != 0) {
        throw SyscallError("sched_setaffinity", errno, "pid " + std::to_string(pid));
    }
}

#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // <linux/mman.h> of Linux 5.14, absent from older libc headers
#endif

void parallel_first_touch(void* address, std::size_t length, std::size_t stride_bytes, int threads) {
    const std::size_t strides = (length + stride_bytes - 1) / stride_bytes;
    if (strides == 0) return;
    const std::size_t workers =
        std::max<std::size_t>(1, std::min<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), strides));
    auto* base = static_cast<volatile unsigned char*>(address);
    auto touch = [=](std::size_t first, std::size_t last) {
        // MADV_POPULATE_WRITE (Linux 5.14) write-faults the range in the kernel, without a
        // trap per page: about twice as fast as the loop on a 4 KB mapping. The loop stays
        // for older kernels and for any range the call leaves unfinished.
        if (last > first && madvise(const_cast<unsigned char*>(base + first * stride_bytes),
                                    (last - first) * stride_bytes, kMadvPopulateWrite) == 0)
            return;
        for (std::size_t i = first; i < last; ++i) base[i * stride_bytes] = 0;
    };
    if (workers == 1) {
        touch(0, strides);
        return;
    }
    // Threads that could not be created (address-space or process limits) leave their
    // share to the calling thread: first touch only has to happen, in parallel where
    // possible. A std::thread that fails to start throws, and every joinable thread must
    // be joined before that can propagate.
    std::vector<std::thread> pool;
    pool.reserve(workers);
    std::size_t started = 1;
    for (; started < workers; ++started) {
        try {
            pool.emplace_back(touch, strides * started / workers, strides * (started + 1) / workers);
        } catch (const std::system_error&) {
            break;
        }
    }
    touch(0, strides / workers);
    touch(strides * started / workers, strides);
    for (auto& t : pool) t.join();
}

InterleavedMapping::InterleavedMapping(std::size_t nbytes, const std::vector<int>& nodes,
                                       bool huge_pages, int touch_threads)
    : nbytes_(nbytes), nodes_(nodes), huge_pages_(huge_pages) {
    if (nodes.empty()) throw SyscallError("mbind", EINVAL, "empty node list");
    std::sort(nodes_.begin(), nodes_.end());
    nodes_.erase(std::unique(nodes_.begin(), nodes_.end()), nodes_.end());
    page_bytes_ = huge_pages ? kHugePageBytes : base_page_bytes();
    // A whole number of interleave pages, at least one, so that no page of the buffer is
    // shared with (or merged into) a neighbouring mapping of another policy.
    mapped_bytes_ = round_up(std::max<std::size_t>(nbytes, 1), page_bytes_);
    // For huge pages the mapping must start on a 2 MiB boundary: the kernel's interleave
    // index is vm_pgoff >> 9 plus the 2 MiB-page offset inside the VMA, which equals the
    // address's 2 MiB frame number only when vm_start is 2 MiB aligned.
    const std::size_t reserve_bytes = mapped_bytes_ + (huge_pages ? page_bytes_ : 0);
    void* raw = mmap(nullptr, reserve_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        throw SyscallError("mmap", errno, std::to_string(reserve_bytes) + " bytes anonymous");
    }
    auto start = reinterpret_cast<std::uintptr_t>(raw);
    if (huge_pages) {
        const std::uintptr_t aligned = round_up(start, page_bytes_);
        if (aligned > start) munmap(raw, aligned - start);
        const std::uintptr_t end = start + reserve_bytes;
        const std::uintptr_t used_end = aligned + mapped_bytes_;
        if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
        start = aligned;
    }
    data_ = reinterpret_cast<void*>(start);
    try {
        // Set the huge-page advice explicitly either way: the granularity of the interleave
        // must not depend on the THP default or on anyone else's madvise.
        if (huge_pages) {
            madvise_range(data_, mapped_bytes_, MADV_HUGEPAGE, "MADV_HUGEPAGE");
        } else {
            madvise_range(data_, mapped_bytes_, MADV_NOHUGEPAGE, "MADV_NOHUGEPAGE");
        }
        mbind_range(data_, mapped_bytes_, kMpolInterleave, nodes_);
        parallel_first_touch(data_, mapped_bytes_, base_page_bytes(), touch_threads);
    } catch (...) {
        unmap();
        throw;
    }
    live_count().fetch_add(1);
}

InterleavedMapping::~InterleavedMapping() {
    if (data_) {
        unmap();
        live_count().fetch_sub(1);
    }
}

void InterleavedMapping::unmap() {
    if (data_) {
        munmap(data_, mapped_bytes_);
        data_ = nullptr;
    }
}

std::atomic<long>& InterleavedMapping::live_count() {
    static std::atomic<long> count{0};
    return count;
}

}  // namespace numa_moe::placement
