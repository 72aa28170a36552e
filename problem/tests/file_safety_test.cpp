// The problem layer's guarantees: writing never destroys a file (an input, a device, a link, a
// stranger's temporary), shapes never overflow, runs too large for the machine are refused with their bytes,
// and bad files get a message a person can act on. Each test failed before the change that made it pass.
#include "problem/generate.h"
#include "problem/memory.h"
#include "problem/problem.h"
#include "problem/problem_io.h"
#include "problem/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace simpo {
namespace {

namespace fs = std::filesystem;

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("file_safety_test_" + std::to_string(::getpid()) + "_" +
                                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

SafetensorsFile small_file(double value = 1.5) {
  SafetensorsFile f;
  f.tensors["loss"] = Tensor::scalar(value);
  return f;
}

template <class F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError";
  return "";
}

std::size_t files_in(const fs::path& dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  return n;
}

// ---- nothing is ever lost ----

TEST(FileSafety, RefusesToReplaceAnInputUnderAnyOfItsNames) {
  TempDir dir;
  const std::string input = dir / "in.safetensors";
  write_safetensors(input, small_file());
  const std::string before = read_all(input);
  fs::create_directories(dir.path / "a");
  fs::create_hard_link(input, dir / "hard.safetensors");
  fs::create_symlink(input, dir / "soft.safetensors");
  for (const std::string& alias : {input, dir / "a/../in.safetensors", dir / "hard.safetensors"}) {
    const std::string m = error_of([&] { write_safetensors(alias, small_file(2.5), {input}); });
    EXPECT_CONTAINS(m, "same file as the input");
    EXPECT_CONTAINS(m, input);
    EXPECT_CONTAINS(m, alias);
  }
  // A symlink is refused before the input comparison even runs: outputs are regular files only.
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "soft.safetensors", small_file(2.5), {input}); }),
                  "is a symbolic link");
  EXPECT_EQ(read_all(input), before);
}

TEST(FileSafety, WritesOnlyRegularFiles) {
  TempDir dir;
  ASSERT_EQ(mkfifo((dir / "fifo").c_str(), 0600), 0);
  fs::create_directories(dir.path / "folder");
  fs::create_symlink(dir / "elsewhere", dir / "dangling");
  EXPECT_CONTAINS(error_of([&] { write_safetensors("/dev/null", small_file()); }), "/dev/null is a device");
  EXPECT_CONTAINS(error_of([&] { write_safetensors("/dev/full", small_file()); }), "is a device");
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "fifo", small_file()); }), "is a FIFO");
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "folder", small_file()); }), "is a directory");
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "dangling", small_file()); }), "is a symbolic link");
  struct stat st {};
  ASSERT_EQ(stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));  // still the device
  EXPECT_TRUE(fs::is_symlink(dir / "dangling"));
  EXPECT_FALSE(fs::exists(dir / "elsewhere"));
}

TEST(FileSafety, TemporaryNamesAreUniqueAndNeverConsumeAnExistingFile) {
  TempDir dir;
  const std::string out = dir / "out.safetensors";
  // Someone else's file at the old fixed temporary name survives untouched.
  { std::ofstream(out + ".tmp") << "not ours"; }
  write_safetensors(out, small_file(3.0));
  EXPECT_EQ(read_all(out + ".tmp"), "not ours");
  EXPECT_EQ(read_safetensors(out).tensors.at("loss").value(0), 3.0);
  EXPECT_EQ(files_in(dir.path), 2u);  // out and the stranger's file: no leftover temporary
}

TEST(FileSafety, AFailedWriteRemovesItsTemporaryAndLeavesTheOldFile) {
  TempDir dir;
  const std::string out = dir / "out.safetensors";
  write_safetensors(out, small_file(1.0));
  const std::string before = read_all(out);
  // A folder we may not write into: mkstemp fails (run as root, permissions do not bind; use a path whose
  // folder does not exist instead, which fails the same way for everyone).
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "missing/out.safetensors", small_file()); }),
                  "cannot create a temporary file");
  EXPECT_EQ(read_all(out), before);
  EXPECT_EQ(files_in(dir.path), 1u);
}

TEST(FileSafety, OutputsGetOrdinaryPermissions) {
  TempDir dir;
  const mode_t mask = umask(022);
  write_safetensors(dir / "out.safetensors", small_file());
  umask(mask);
  struct stat st {};
  ASSERT_EQ(stat((dir / "out.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

// ---- shapes and memory ----

TEST(ShapeArithmetic, NumelOfAHugeShapeWithAZeroIsRefusedNotOverflowed) {
  // [2^32, 2^31, 0] has zero elements, but 2^32 * 2^31 overflows int64 before the 0 is reached.
  const std::string file = [] {
    const std::string header = R"({"grad_x":{"dtype":"BF16","shape":[4294967296,2147483648,0],"data_offsets":[0,0]}})";
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    return out + header;
  }();
  EXPECT_CONTAINS(error_of([&] { parse_safetensors(file, "candidate.safetensors"); }),
                  "more elements than 64-bit sizes can count");
  Tensor t;
  t.shape = {std::int64_t{1} << 32, std::int64_t{1} << 31, 0};
  EXPECT_CONTAINS(error_of([&] { (void)t.numel(); }), "64-bit");
  EXPECT_EQ(checked_numel({std::int64_t{1} << 20, 0, std::int64_t{1} << 20}), 0);
}

TEST(ShapeArithmetic, ValidateShapeDoesNotOverflowOnHugeDimensions) {
  const std::int64_t huge = std::int64_t{1} << 62;
  EXPECT_CONTAINS(error_of([&] { validate_shape({2, huge, 1, 2}); }), "too large");
  EXPECT_CONTAINS(error_of([&] { validate_shape({huge, huge, 1, 2}); }), "too large");
}

TEST(Memory, GeneratingMoreThanTheMachineHasIsRefusedWithTheBytes) {
  // case --B 2 --T 1 --H 1 --V 1099511627776: 2 TiB of weight (+ 4 bytes of x, 16 of target), refused before a
  // byte is allocated.
  CaseSpec spec;
  spec.shape = {2, 1, 1, std::int64_t{1} << 40};
  const std::string m = error_of([&] { generate(spec); });
  EXPECT_CONTAINS(m, "needs 2199023255572 bytes");
  EXPECT_CONTAINS(m, "available");
}

TEST(Memory, TheLimitHonoursTheEnvironmentCapAndNamesIt) {
  ::setenv("SIMPO_MEMORY_LIMIT_BYTES", "1000", 1);
  const MemoryLimit limit = available_memory();
  const std::string m = error_of([&] { require_memory(4096, "this run"); });
  ::unsetenv("SIMPO_MEMORY_LIMIT_BYTES");
  EXPECT_EQ(limit.bytes, 1000);
  EXPECT_EQ(limit.source, "SIMPO_MEMORY_LIMIT_BYTES");
  EXPECT_CONTAINS(m, "this run needs 4096 bytes");
  EXPECT_CONTAINS(m, "only 1000 bytes");
  EXPECT_GT(available_memory().bytes, 1000);  // without the cap: this machine's real limit
}

// ---- bad input gets a message a person can act on ----

TEST(BadInput, AnUnknownMetadataKeyIsNamedWithTheNearestKnownOne) {
  CaseSpec spec;
  spec.shape = {2, 2, 4, 8};
  SafetensorsFile f = problem_to_file(generate(spec));
  f.metadata.erase("beta");
  f.metadata["betta"] = "0.3";
  const std::string m = error_of([&] { problem_from_file(f, "typo.safetensors"); });
  EXPECT_CONTAINS(m, "typo.safetensors");
  EXPECT_CONTAINS(m, "\"betta\"");
  EXPECT_CONTAINS(m, "did you mean \"beta\"");
  // Keys other tools write are not errors.
  f.metadata.erase("betta");
  f.metadata["format"] = "pt";
  EXPECT_NO_THROW(problem_from_file(f, "hf.safetensors"));
}

TEST(BadInput, ADirectoryIsNamedAsADirectory) {
  TempDir dir;
  const std::string m = error_of([&] { read_safetensors(dir.path.string()); });
  EXPECT_CONTAINS(m, "is a directory");
  EXPECT_EQ(m.find("8-byte"), std::string::npos) << m;
  ASSERT_EQ(mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_CONTAINS(error_of([&] { read_safetensors(dir / "fifo"); }), "is a FIFO");  // and no hang
}

TEST(BadInput, ZeroLengthTensorsAtOneOffsetAreTheShapeErrorNotAnOverlap) {
  // An H = 0 inputs file: x [2, 3, 0] and weight [5, 0] both occupy [0, 0).
  SafetensorsFile f;
  f.tensors["x"] = Tensor(DType::BF16, {2, 3, 0});
  f.tensors["weight"] = Tensor(DType::BF16, {5, 0});
  f.tensors["target"] = Tensor(DType::I64, {2, 3});
  std::string bytes = serialize_safetensors(f);
  const SafetensorsFile back = parse_safetensors(bytes, "h0.safetensors");
  const std::string m = error_of([&] { validate(problem_from_file(back, "h0.safetensors")); });
  EXPECT_CONTAINS(m, "invalid shape");
  EXPECT_EQ(m.find("overlap"), std::string::npos) << m;
}

}  // namespace
}  // namespace simpo
