#include "problem/safetensors.h"

#include "problem/memory.h"
#include "problem/problem.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace simpo {

namespace {

struct Entry {
  std::string name;
  std::uint64_t begin, end;
};

std::int64_t checked_int(const nlohmann::json& j, const std::string& what) {
  if (!j.is_number_integer() || j.get<std::int64_t>() < 0) throw InputError(what + " must be a non-negative integer");
  return j.get<std::int64_t>();
}

}  // namespace

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& source) {
  auto fail = [&](const std::string& why) -> InputError { return InputError(source + ": not a valid safetensors file: " + why); };
  if (bytes.size() < 8) throw fail("shorter than the 8-byte header length (" + std::to_string(bytes.size()) + " bytes)");
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  if (header_len > bytes.size() - 8)
    throw fail("header length " + std::to_string(header_len) + " runs past the end of the file (" +
               std::to_string(bytes.size()) + " bytes)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw fail("header is not a JSON object");

  const std::uint64_t data_begin = 8 + header_len;
  const std::uint64_t data_size = bytes.size() - data_begin;
  SafetensorsFile file;
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    try {
      if (name == "__metadata__") {
        if (!info.is_object()) throw InputError("__metadata__ must be an object of strings");
        for (const auto& [k, v] : info.items()) {
          if (!v.is_string()) throw InputError("__metadata__[\"" + k + "\"] is not a string");
          file.metadata[k] = v.get<std::string>();
        }
        continue;
      }
      if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
        throw InputError("entry needs dtype, shape and data_offsets");
      if (!info["dtype"].is_string()) throw InputError("dtype must be a string");
      Tensor t;
      t.dtype = dtype_from_name(info["dtype"].get<std::string>());
      if (!info["shape"].is_array()) throw InputError("shape must be an array");
      for (const auto& d : info["shape"]) t.shape.push_back(checked_int(d, "each shape entry"));
      const auto& off = info["data_offsets"];
      if (!off.is_array() || off.size() != 2) throw InputError("data_offsets must be [begin, end]");
      const auto begin = static_cast<std::uint64_t>(checked_int(off[0], "data_offsets begin"));
      const auto end = static_cast<std::uint64_t>(checked_int(off[1], "data_offsets end"));
      if (begin > end || end > data_size)
        throw InputError("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                         "] are out of range of the " + std::to_string(data_size) + "-byte data section");
      const auto size = static_cast<std::uint64_t>(checked_numel(t.shape, dtype_size(t.dtype))) * dtype_size(t.dtype);
      if (size != end - begin)
        throw InputError(dtype_name(t.dtype) + " " + shape_string(t.shape) + " disagrees with its " +
                         std::to_string(end - begin) + " bytes of data");
      const char* src = bytes.data() + data_begin + begin;
      t.bytes.assign(reinterpret_cast<const std::byte*>(src), reinterpret_cast<const std::byte*>(src) + (end - begin));
      entries.push_back({name, begin, end});
      file.tensors.emplace(name, std::move(t));
    } catch (const InputError& e) {
      throw fail("tensor \"" + name + "\": " + e.what());
    }
  }
  // Zero-length tensors occupy no bytes, so they overlap nothing (an H = 0 file puts x and weight at one
  // offset; its shape is then what validation names).
  std::erase_if(entries, [](const Entry& e) { return e.begin == e.end; });
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < entries.size(); ++i)
    if (entries[i].begin < entries[i - 1].end)
      throw fail("tensors \"" + entries[i - 1].name + "\" and \"" + entries[i].name + "\" overlap in the data section");
  return file;
}

std::string serialize_safetensors(const SafetensorsFile& file) {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {  // std::map: name order, so the bytes are deterministic
    const std::uint64_t size = t.bytes.size();
    header[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section to 8 bytes, as Hugging Face does
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  out += text;
  out.reserve(out.size() + offset);
  for (const auto& [name, t] : file.tensors) out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  return out;
}

namespace {

// "a directory", "a symbolic link", ...: what a path is when it is not a regular file; empty when it is one.
std::string not_regular_kind(const struct stat& st) {
  if (S_ISREG(st.st_mode)) return {};
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "a device";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

SafetensorsFile read_safetensors(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) throw InputError(path + ": cannot open for reading (" + errno_text() + ")");
  if (const std::string kind = not_regular_kind(st); !kind.empty())
    throw InputError(path + " is " + kind + ", not a safetensors file");
  // The file's bytes, then its tensors: about twice its size while parsing.
  require_memory(2 * static_cast<std::int64_t>(st.st_size), "reading " + path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open for reading");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw InputError(path + ": read error");
  return parse_safetensors(buffer.str(), path);
}

void check_writable(const std::string& path, const std::vector<std::string>& never_replace) {
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (const std::string kind = not_regular_kind(st); !kind.empty())
      throw InputError(path + " is " + kind + "; outputs are written only as regular files (give another path)");
    for (const std::string& input : never_replace) {
      std::error_code ec;
      if (std::filesystem::equivalent(path, input, ec))
        throw InputError("refusing to write " + path + ": it is the same file as the input " + input +
                         ", which would be lost (give another output path)");
    }
  } else if (errno != ENOENT) {
    throw InputError(path + ": cannot write here (" + errno_text() + ")");
  }
}

void write_safetensors(const std::string& path, const SafetensorsFile& file, const std::vector<std::string>& never_replace) {
  check_writable(path, never_replace);
  const std::string bytes = serialize_safetensors(file);
  const std::filesystem::path target(path);
  const std::filesystem::path folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string tmp = (folder / std::string(".").append(target.filename().string()).append(".XXXXXX")).string();  // (GCC 12 -Wrestrict misfires on "." + string)
  const int fd = mkstemp(tmp.data());
  if (fd < 0) throw InputError(path + ": cannot create a temporary file in " + folder.string() + " (" + errno_text() + ")");
  auto fail = [&](const std::string& why) {
    const std::string message = path + ": " + why + " (" + errno_text() + ")";
    close(fd);
    unlink(tmp.c_str());
    return InputError(message);
  };
  // mkstemp creates the file 0600; an outputs file gets the permissions any new file would (0666 less umask).
  const mode_t mask = umask(0);
  umask(mask);
  if (fchmod(fd, 0666 & ~mask) != 0) throw fail("cannot set the temporary file's permissions");
  for (std::size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw fail("write failed after " + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes");
    done += static_cast<std::size_t>(n);
  }
  if (fsync(fd) != 0) throw fail("write failed (fsync)");
  if (close(fd) != 0) {
    const std::string message = path + ": write failed on close (" + errno_text() + ")";
    unlink(tmp.c_str());
    throw InputError(message);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string message = path + ": cannot rename the finished file into place (" + errno_text() + ")";
    unlink(tmp.c_str());
    throw InputError(message);
  }
}

}  // namespace simpo
