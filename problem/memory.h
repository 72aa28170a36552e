// How much memory a run may take, asked before allocating: a run too large for this machine is refused with an
// InputError naming the bytes it needs and the bytes there are, instead of dying in std::bad_alloc (or the
// kernel's OOM killer: Linux overcommits, so a large allocation can succeed and kill the process when touched).
#pragma once

#include <cstdint>
#include <string>

namespace simpo {

struct MemoryLimit {
  std::int64_t bytes;  // what this process may still allocate
  std::string source;  // which limit binds: "MemAvailable", "ulimit -v", "cgroup memory.max"
};

// The tightest of: the kernel's MemAvailable (/proc/meminfo), this process's address-space and data limits
// (RLIMIT_AS, RLIMIT_DATA, less what it already maps), and its cgroup's memory.max less memory.current.
MemoryLimit available_memory();

// Throws InputError "<what> needs N bytes (x GiB) of host memory; only M (y GiB) are available (<source>)" when
// bytes exceeds what is available. SIMPO_MEMORY_LIMIT_BYTES, when set, caps the limit (tests; a user who wants
// a run to stay small).
void require_memory(std::int64_t bytes, const std::string& what);

std::string byte_count(std::int64_t bytes);  // "12884901888 bytes (12.0 GiB)"

}  // namespace simpo
