// Thin wrappers over the Linux memory-placement system calls (mmap, mbind, madvise,
// move_pages, get_mempolicy, sched_{set,get}affinity). Raw syscall(2) is used so that
// no libnuma development headers are needed at build time. Every failure throws
// SyscallError carrying the call's name and errno; nothing here talks to Python.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace numa_moe::placement {

// Linux <linux/mempolicy.h> values (stable ABI).
constexpr int kMpolDefault = 0;
constexpr int kMpolPreferred = 1;
constexpr int kMpolBind = 2;
constexpr int kMpolInterleave = 3;
constexpr int kMpolLocal = 4;
constexpr int kMpolFNode = 1 << 0;
constexpr int kMpolFAddr = 1 << 1;
constexpr int kMpolFMemsAllowed = 1 << 2;
constexpr int kMpolMfMove = 1 << 1;

// Highest node id representable in the node masks we pass (Linux MAX_NUMNODES is <= 1024).
constexpr int kMaxNodes = 1024;

class SyscallError : public std::runtime_error {
public:
    SyscallError(std::string call, int error_number, const std::string& detail);
    const std::string& call() const { return call_; }
    int error_number() const { return errno_; }

private:
    std::string call_;
    int errno_;
};

std::size_t base_page_bytes();

// A node mask in the kernel's unsigned-long bit layout, plus the `maxnode` to pass.
struct NodeMask {
    std::vector<unsigned long> words;
    unsigned long maxnode() const { return words.size() * 8 * sizeof(unsigned long) + 1; }
};
NodeMask make_node_mask(const std::vector<int>& nodes);
std::vector<int> node_mask_to_list(const NodeMask& mask);

// mbind(2) over [address, address + length) with the given mode and nodes.
void mbind_range(void* address, std::size_t length, int mode, const std::vector<int>& nodes);
void madvise_range(void* address, std::size_t length, int advice, const char* advice_name);

struct MemPolicy {
    int mode = kMpolDefault;
    std::vector<int> nodes;
};
// Policy of the VMA holding `address` (flags MPOL_F_ADDR), or of the calling thread
// when address == nullptr.
MemPolicy get_mempolicy_of(const void* address);
std::vector<int> mems_allowed();

// move_pages(2) status query: per page, the node id or a negative errno (-ENOENT for a
// page that is not present, -EFAULT for an unmapped address or the shared zero page).
void query_page_nodes(const std::uintptr_t* pages, std::size_t count, int* status_out);
// move_pages(2) with targets. Returns the syscall's count of pages not migrated (>= 0);
// per-page outcome (node or negative errno) lands in status_out.
long move_pages_to(const std::uintptr_t* pages, const int* target_nodes, std::size_t count,
                   int* status_out);

// mincore(2) over [address, address + length) (address page-aligned): per base page,
// whether it is resident (in RAM or the page cache), without touching it.
void query_resident_pages(const void* address, std::size_t length, unsigned char* resident_out);

std::vector<int> get_affinity(int pid);
void set_affinity(int pid, const std::vector<int>& cpus);

// Faults every page of [address, address + length) in by a write (first touch), using up
// to `threads` threads: MADV_POPULATE_WRITE where the kernel has it, else one byte written
// per `stride_bytes` (address and stride page-aligned).
void parallel_first_touch(void* address, std::size_t length, std::size_t stride_bytes,
                          int threads);

// An anonymous private mapping with MPOL_INTERLEAVE over `nodes`, set before any page is
// touched; huge_pages chooses MADV_HUGEPAGE (mapping aligned to 2 MiB) or MADV_NOHUGEPAGE.
// Unmapped by the destructor.
class InterleavedMapping {
public:
    InterleavedMapping(std::size_t nbytes, const std::vector<int>& nodes, bool huge_pages,
                       int touch_threads);
    ~InterleavedMapping();
    InterleavedMapping(const InterleavedMapping&) = delete;
    InterleavedMapping& operator=(const InterleavedMapping&) = delete;

    void* data() const { return data_; }
    std::size_t nbytes() const { return nbytes_; }
    std::size_t mapped_bytes() const { return mapped_bytes_; }
    std::size_t page_bytes() const { return page_bytes_; }
    const std::vector<int>& nodes() const { return nodes_; }
    bool huge_pages() const { return huge_pages_; }
    // Mappings alive in this process (tests check that the last view unmaps).
    static std::atomic<long>& live_count();

private:
    void unmap();
    void* data_ = nullptr;
    std::size_t nbytes_ = 0;
    std::size_t mapped_bytes_ = 0;
    std::size_t page_bytes_ = 0;
    std::vector<int> nodes_;
    bool huge_pages_ = false;
};

constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

}  // namespace numa_moe::placement
