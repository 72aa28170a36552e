#include "problem/memory.h"

#include "problem/problem.h"

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

namespace simpo {

namespace {

constexpr std::int64_t kUnlimited = std::numeric_limits<std::int64_t>::max();

// "Key:   123 kB" lines of /proc/meminfo and /proc/self/status, in bytes; -1 when absent.
std::int64_t proc_kib_field(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, key.size() + 1, key + ":") == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      std::int64_t kib = -1;
      fields >> kib;
      return kib < 0 ? -1 : kib * 1024;
    }
  return -1;
}

std::int64_t read_cgroup_value(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return kUnlimited;
  std::int64_t v = 0;
  auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  return r.ec == std::errc() ? v : kUnlimited;
}

// This process's cgroup v2 folder ("0::/path" in /proc/self/cgroup).
std::string cgroup_folder() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("0::", 0) == 0) return "/sys/fs/cgroup" + line.substr(3);
  return {};
}

}  // namespace

MemoryLimit available_memory() {
  MemoryLimit best{kUnlimited, "no limit"};
  auto consider = [&](std::int64_t bytes, const char* source) {
    if (bytes >= 0 && bytes < best.bytes) best = {bytes, source};
  };
  consider(proc_kib_field("/proc/meminfo", "MemAvailable"), "the kernel's MemAvailable");
  const std::int64_t mapped = std::max<std::int64_t>(0, proc_kib_field("/proc/self/status", "VmSize"));
  const std::int64_t data = std::max<std::int64_t>(0, proc_kib_field("/proc/self/status", "VmData"));
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    consider(std::max<std::int64_t>(0, static_cast<std::int64_t>(limit.rlim_cur) - mapped), "ulimit -v (RLIMIT_AS)");
  if (getrlimit(RLIMIT_DATA, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    consider(std::max<std::int64_t>(0, static_cast<std::int64_t>(limit.rlim_cur) - data), "ulimit -d (RLIMIT_DATA)");
  const std::string cgroup = cgroup_folder();
  if (!cgroup.empty()) {
    const std::int64_t max = read_cgroup_value(cgroup + "/memory.max");
    if (max != kUnlimited)
      consider(std::max<std::int64_t>(0, max - read_cgroup_value(cgroup + "/memory.current")), "the cgroup's memory.max");
  }
  if (const char* cap = std::getenv("SIMPO_MEMORY_LIMIT_BYTES")) {
    std::int64_t v = 0;
    const std::string text = cap;
    auto r = std::from_chars(text.data(), text.data() + text.size(), v);
    if (r.ec != std::errc() || r.ptr != text.data() + text.size() || v < 0)
      throw InputError("SIMPO_MEMORY_LIMIT_BYTES=\"" + text + "\" is not a byte count");
    consider(v, "SIMPO_MEMORY_LIMIT_BYTES");
  }
  return best;
}

std::string byte_count(std::int64_t bytes) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%lld bytes (%.1f GiB)", static_cast<long long>(bytes),
                static_cast<double>(bytes) / static_cast<double>(1 << 30));
  return buf;
}

void require_memory(std::int64_t bytes, const std::string& what) {
  const MemoryLimit limit = available_memory();
  if (bytes > limit.bytes)
    throw InputError(what + " needs " + byte_count(bytes) + " of host memory; only " + byte_count(limit.bytes) +
                     " are available (" + limit.source + ")");
}

}  // namespace simpo
