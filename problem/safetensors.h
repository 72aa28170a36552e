// The Hugging Face safetensors format (8-byte little-endian header length, JSON header, raw little-endian
// data), with SPEC's dtypes BF16, F16, F32, F64, I64. No C++ library for it is packaged here, so this is ours.
// Every malformed file is an InputError naming the file and the problem, never a crash.
#pragma once

#include "problem/tensor.h"

#include <map>
#include <string>
#include <vector>

namespace simpo {

struct SafetensorsFile {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__": string to string
};

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& source_name);
std::string serialize_safetensors(const SafetensorsFile&);  // deterministic: tensors in name order

// Reads a regular file; a directory, a FIFO or a device is an InputError saying which, and a file larger than the
// memory available (problem/memory.h) is refused before it is read.
SafetensorsFile read_safetensors(const std::string& path);

// Nothing a write does can lose a file:
// - `path` must be a regular file or not exist: a symbolic link, a device (/dev/null, /dev/full), a FIFO or a
//   directory is refused, never replaced;
// - `path` must not be any of `never_replace` (the command's inputs), compared as files (the same inode), so
//   `./a/../a`, a hard link or a symlink to an input are caught too;
// - the bytes go to a unique temporary file beside `path` (mkstemp), flushed, then renamed over it; on every
//   failure the temporary is removed and `path` is untouched.
// check_writable() runs the first two checks alone, so a command can refuse before it spends minutes computing.
void check_writable(const std::string& path, const std::vector<std::string>& never_replace = {});
void write_safetensors(const std::string& path, const SafetensorsFile&, const std::vector<std::string>& never_replace = {});

}  // namespace simpo
