#include "problem/safetensors.h"

#include "problem/problem.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
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
      std::uint64_t count = 1;
      bool overflow = false;
      for (auto d : t.shape) overflow |= __builtin_mul_overflow(count, static_cast<std::uint64_t>(d), &count);
      std::uint64_t size = 0;
      overflow |= __builtin_mul_overflow(count, dtype_size(t.dtype), &size);
      if (overflow || size != end - begin)
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

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open for reading");
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw InputError(path + ": read error");
  return parse_safetensors(buffer.str(), path);
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  const std::string bytes = serialize_safetensors(file);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(path + ": cannot open for writing");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw InputError(path + ": write failed (disk full?)");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw InputError(path + ": cannot rename the finished file into place");
  }
}

}  // namespace simpo
