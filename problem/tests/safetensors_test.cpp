// The safetensors reader and writer: every dtype survives a round trip bit for bit, the layout is the one
// Hugging Face's library reads, and every malformed file is an InputError that names the file and the
// problem (never a crash, never a silently wrong tensor).
#include "problem/problem.h"
#include "problem/problem_io.h"
#include "problem/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace simpo {
namespace {

// A safetensors file built by hand: 8-byte little-endian header length, the header text, then the data.
// The malformed-file tests need files our writer would never produce.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((std::uint64_t{header.size()} >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string le_bytes(std::uint64_t v, int n) {
  std::string s(static_cast<std::size_t>(n), '\0');
  for (int i = 0; i < n; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// One tensor of every dtype SPEC uses, with values that catch byte-order and truncation slips: bf16 and f32
// values that are not representable in fewer bits, a double that needs all 53 bits, int64 beyond 2^32.
SafetensorsFile every_dtype_file() {
  SafetensorsFile f;
  const std::vector<bf16> b = {bf16(1.0f), bf16(-0.0078125f), bf16(3.140625f), bf16(-65280.0f), bf16(1e-30f),
                               bf16(0.5f)};
  f.tensors["a_bf16"] = Tensor::from<bf16>({2, 3}, b);
  const std::vector<float> s = {0.1f, -2.5e-38f, 3.4e38f, 7.0f};
  f.tensors["b_f32"] = Tensor::from<float>({4}, s);
  f.tensors["c_f64_scalar"] = Tensor::scalar<double>(0.1 + 0.2);  // 0.30000000000000004: all 53 bits matter
  const std::vector<std::int64_t> i = {-100, 0, std::int64_t{1} << 40, std::numeric_limits<std::int64_t>::min()};
  f.tensors["d_i64"] = Tensor::from<std::int64_t>({2, 1, 2}, i);
  f.tensors["e_f32_scalar"] = Tensor::scalar<float>(-1.5f);
  f.tensors["f_i64_scalar"] = Tensor::scalar<std::int64_t>(-7);
  const std::vector<f16> h = {f16(1.0f), f16(-65504.0f), f16(0x1p-24f), f16(0.1f)};  // max, smallest subnormal
  f.tensors["a_f16"] = Tensor::from<f16>({4}, h);
  f.metadata = {{"seed", "42"}, {"description", "every dtype, \"quoted\" and unicode: \xce\xb2"}, {"empty", ""}};
  return f;
}

void expect_same(const SafetensorsFile& a, const SafetensorsFile& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    auto it = b.tensors.find(name);
    ASSERT_NE(it, b.tensors.end()) << name;
    EXPECT_EQ(t.dtype, it->second.dtype) << name;
    EXPECT_EQ(t.shape, it->second.shape) << name;
    EXPECT_EQ(t.bytes, it->second.bytes) << name;  // bit for bit, -0.0 and all
  }
}

// Runs parse_safetensors on bytes that must be rejected; returns the message for the caller to inspect.
std::string parse_error(const std::string& bytes) {
  try {
    parse_safetensors(bytes, "case.safetensors");
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse_safetensors accepted a malformed file";
  return "";
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(Safetensors, RoundTripEveryDtypeScalarsAndMetadata) {
  const SafetensorsFile f = every_dtype_file();
  const SafetensorsFile back = parse_safetensors(serialize_safetensors(f), "memory");
  expect_same(f, back);
  EXPECT_EQ(back.tensors.at("c_f64_scalar").shape, std::vector<std::int64_t>{});
  EXPECT_EQ(back.tensors.at("c_f64_scalar").as<double>()[0], 0.1 + 0.2);
  EXPECT_EQ(back.tensors.at("d_i64").as<std::int64_t>()[3], std::numeric_limits<std::int64_t>::min());
}

TEST(Safetensors, RoundTripThroughADiskFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("safetensors_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "every_dtype.safetensors").string();
  write_safetensors(path, every_dtype_file());
  expect_same(every_dtype_file(), read_safetensors(path));
  // The write goes through a temporary file that is renamed into place: nothing else is left behind.
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1);
  std::filesystem::remove_all(dir);
}

TEST(Safetensors, EmptyFileAndZeroSizedTensorRoundTrip) {
  expect_same(SafetensorsFile{}, parse_safetensors(serialize_safetensors(SafetensorsFile{}), "memory"));
  SafetensorsFile f;
  f.tensors["nothing"] = Tensor(DType::F32, {0, 3});
  expect_same(f, parse_safetensors(serialize_safetensors(f), "memory"));
}

TEST(Safetensors, SerializationIsDeterministicAndLaidOutInNameOrder) {
  const SafetensorsFile f = every_dtype_file();
  const std::string bytes = serialize_safetensors(f);
  EXPECT_EQ(bytes, serialize_safetensors(every_dtype_file()));

  // Layout as the Hugging Face reader expects it: the length prefix counts the header exactly, the header is a
  // JSON object padded to 8 bytes (so the data of every tensor is aligned), then the tensors' raw bytes back to
  // back in name order with nothing after them.
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  EXPECT_EQ(header_len % 8, 0u);
  ASSERT_LE(8 + header_len, bytes.size());
  EXPECT_EQ(bytes[8], '{');
  std::string data;
  for (const auto& [name, t] : f.tensors) data.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  EXPECT_EQ(bytes.substr(8 + header_len), data);
}

TEST(Safetensors, ReadsAFileWrittenTheWayHuggingFaceWritesIt) {
  // What safetensors.torch.save_file writes for {"w": torch.tensor([[1., -2.]], dtype=torch.bfloat16),
  // "n": torch.tensor(5)}: compact JSON, __metadata__ first, keys in any order, space padding to 8 bytes.
  std::string header = R"({"__metadata__":{"format":"pt"},"n":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                       R"("w":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string data = le_bytes(5, 8) + le_bytes(0x3f80, 2) + le_bytes(0xc000, 2);  // 1.0 and -2.0 in bf16
  const SafetensorsFile f = parse_safetensors(raw_file(header, data), "hf.safetensors");
  EXPECT_EQ(f.metadata.at("format"), "pt");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors.at("n").dtype, DType::I64);
  EXPECT_EQ(f.tensors.at("n").shape, std::vector<std::int64_t>{});
  EXPECT_EQ(f.tensors.at("n").value(0), 5.0);
  EXPECT_EQ(f.tensors.at("w").dtype, DType::BF16);
  EXPECT_EQ(f.tensors.at("w").shape, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(f.tensors.at("w").value(0), 1.0);
  EXPECT_EQ(f.tensors.at("w").value(1), -2.0);
}

// ---- malformed files: each an InputError naming the file and what is wrong ----

TEST(SafetensorsMalformed, ShorterThanTheLengthPrefix) {
  const std::string m = parse_error(std::string("\x08\x00\x00", 3));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "8-byte");
  EXPECT_CONTAINS(parse_error(""), "case.safetensors");
}

TEST(SafetensorsMalformed, TruncatedData) {
  const std::string full = serialize_safetensors(every_dtype_file());
  // Cut inside the data section: the last tensor's offsets now point past the end.
  const std::string m = parse_error(full.substr(0, full.size() - 3));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "f_i64_scalar");  // the tensor whose bytes are missing
  EXPECT_CONTAINS(m, "out of range");
}

TEST(SafetensorsMalformed, HeaderLengthPastTheEnd) {
  std::string bytes = raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  bytes.replace(0, 8, le_bytes(1000, 8));
  std::string m = parse_error(bytes);
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "header length 1000");
  // A length whose 8 + len overflows 64 bits must not wrap around into "fits".
  bytes.replace(0, 8, le_bytes(~std::uint64_t{0} - 3, 8));
  m = parse_error(bytes);
  EXPECT_CONTAINS(m, "runs past the end");
}

TEST(SafetensorsMalformed, BadJson) {
  const std::string m = parse_error(raw_file(R"({"a":{"dtype":"F32",)", ""));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "not valid JSON");
}

TEST(SafetensorsMalformed, HeaderNotAnObject) {
  for (const char* header : {"[1, 2, 3]", "\"x\"", "42", "null"}) {
    const std::string m = parse_error(raw_file(header, ""));
    EXPECT_CONTAINS(m, "case.safetensors");
    EXPECT_CONTAINS(m, "not a JSON object");
  }
}

TEST(SafetensorsMalformed, DtypeAndShapeDisagreeWithByteCount) {
  // F32 [3] needs 12 bytes; the offsets give 8.
  const std::string m =
      parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "\"w\"");
  EXPECT_CONTAINS(m, "F32 [3]");
  EXPECT_CONTAINS(m, "8 bytes");
  // A shape whose element count overflows 64 bits is rejected, not wrapped to a small size.
  const std::string big = parse_error(raw_file(
      R"({"w":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})", ""));
  EXPECT_CONTAINS(big, "more elements than 64-bit sizes can count");
}

TEST(SafetensorsMalformed, OffsetsOutOfRange) {
  // end past the data section
  std::string m = parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "\"w\"");
  EXPECT_CONTAINS(m, "out of range");
  // begin after end
  m = parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "out of range");
  // negative and non-integer offsets
  m = parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "data_offsets");
  m = parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.5]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "data_offsets");
  m = parse_error(raw_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", std::string(8, '\0')));
  EXPECT_CONTAINS(m, "data_offsets");
}

TEST(SafetensorsMalformed, OverlappingOffsets) {
  const std::string m = parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                             std::string(12, '\0')));
  EXPECT_CONTAINS(m, "case.safetensors");
  EXPECT_CONTAINS(m, "\"a\"");
  EXPECT_CONTAINS(m, "\"b\"");
  EXPECT_CONTAINS(m, "overlap");
}

TEST(SafetensorsMalformed, UnknownDtype) {
  for (const char* dtype : {"F8_E4M3", "U8", "bf16", ""}) {
    const std::string header =
        std::string(R"({"w":{"dtype":")") + dtype + R"(","shape":[1],"data_offsets":[0,2]}})";
    const std::string m = parse_error(raw_file(header, std::string(2, '\0')));
    EXPECT_CONTAINS(m, "case.safetensors");
    EXPECT_CONTAINS(m, "\"w\"");
    EXPECT_CONTAINS(m, std::string("\"") + dtype + "\"");
  }
}

TEST(SafetensorsMalformed, EntriesOfTheWrongKind) {
  const std::string data(8, '\0');
  for (const char* header : {
           R"({"w":[1,2]})",                                                  // entry not an object
           R"({"w":{"dtype":"F32","shape":[2]}})",                            // no data_offsets
           R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})",           // dtype not a string
           R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})",         // shape not an array
           R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",      // negative dimension
           R"({"__metadata__":{"seed":1}})",                                  // metadata value not a string
           R"({"__metadata__":["seed"]})",                                    // metadata not an object
       }) {
    const std::string m = parse_error(raw_file(header, data));
    EXPECT_CONTAINS(m, "case.safetensors");
  }
}

TEST(SafetensorsMalformed, MissingFileNamesThePath) {
  try {
    read_safetensors("/nonexistent/dir/inputs.safetensors");
    FAIL() << "read of a missing file succeeded";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "/nonexistent/dir/inputs.safetensors");
  }
  EXPECT_THROW(write_safetensors("/nonexistent/dir/out.safetensors", every_dtype_file()), InputError);
}

// No byte string of a small file crashes the parser: every single-byte corruption of a valid file is
// either still a valid file or an InputError. (The sanitizer-free version of a fuzz test.)
TEST(SafetensorsMalformed, EverySingleByteCorruptionIsHandled) {
  const std::string good = serialize_safetensors(every_dtype_file());
  for (std::size_t i = 0; i < good.size(); ++i)
    for (unsigned char flip : {0x01, 0x80, 0xff}) {
      std::string bad = good;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ flip);
      try {
        parse_safetensors(bad, "corrupt");
      } catch (const InputError&) {
      }
    }
  // Every prefix, too: a file cut anywhere.
  for (std::size_t n = 0; n < good.size(); ++n) EXPECT_THROW(parse_safetensors(good.substr(0, n), "cut"), InputError) << n;
}

// ---- inputs files (problem_io): every hyperparameter travels in __metadata__ ----

Problem small_problem() {
  Problem p;
  p.shape = {2, 3, 4, 5};
  for (int i = 0; i < 24; ++i) p.x.as<bf16>().push_back(bf16(0.25f * static_cast<float>(i - 12)));
  for (int i = 0; i < 20; ++i) p.weight.as<bf16>().push_back(bf16(-0.125f * static_cast<float>(i % 7)));
  p.bias = std::vector<bf16>{bf16(1.0f), bf16(-1.0f), bf16(0.5f), bf16(0.0f), bf16(2.0f)};
  p.target = {0, 1, -100, 4, 3, 2};
  return p;
}

TEST(ProblemFile, RoundTripKeepsEveryHyperparameterExactly) {
  Problem p = small_problem();
  // Values whose decimal text must be shortest-round-trip to survive (0.1, 1/3), and non-defaults everywhere.
  p.hp = {.beta = 0.1 * 3, .gamma = -1.0 / 3.0, .alpha = 0.0, .label_smoothing = 0.5, .compute_nll_loss = false,
          .ignore_index = std::numeric_limits<std::int64_t>::min() + 1, .grad_scale = 1e-300,
          .empty_sequence = EmptySequence::zero};
  p.target = {0, 1, p.hp.ignore_index, 4, 3, 2};
  p.seed = "123";
  p.description = "round trip";
  const SafetensorsFile file = parse_safetensors(serialize_safetensors(problem_to_file(p)), "memory");
  EXPECT_EQ(file.metadata.at("compute_nll_loss"), "false");
  EXPECT_EQ(file.metadata.at("empty_sequence"), "zero");
  const Problem q = problem_from_file(file, "memory");
  EXPECT_EQ(q.shape, p.shape);
  EXPECT_EQ(q.hp, p.hp);
  EXPECT_EQ(q.target, p.target);
  EXPECT_EQ(q.seed, "123");
  EXPECT_EQ(q.description, "round trip");
  ASSERT_TRUE(q.bias);
  EXPECT_EQ(serialize_safetensors(problem_to_file(q)), serialize_safetensors(problem_to_file(p)));
}

TEST(ProblemFile, AbsentHyperparametersTakeSpecDefaults) {
  SafetensorsFile f = problem_to_file(small_problem());
  f.metadata.clear();
  EXPECT_EQ(problem_from_file(f, "memory").hp, Hyperparameters{});
}

TEST(ProblemFile, BadMetadataValueNamesTheKey) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"beta", "0.1x"}, {"ignore_index", "1.5"}, {"compute_nll_loss", "yes"}, {"empty_sequence", "nan"}}) {
    SafetensorsFile f = problem_to_file(small_problem());
    f.metadata[key] = value;
    try {
      problem_from_file(f, "in.safetensors");
      ADD_FAILURE() << key << " = " << value << " accepted";
    } catch (const InputError& e) {
      EXPECT_CONTAINS(e.what(), "in.safetensors");
      EXPECT_CONTAINS(e.what(), key);
      EXPECT_CONTAINS(e.what(), value);
    }
  }
}

// SPEC: inputs in BF16, F16 or F32 travel through a file bit for bit, their dtype with them.
TEST(ProblemFile, F16AndF32InputsRoundTripExactly) {
  const Problem bf = small_problem();
  auto converted = [&]<class T>(T) {
    Problem p = bf;
    auto as = [](const InputValues& v) {
      std::vector<T> out(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) out[i] = T(static_cast<float>(v.value(i)));
      return out;
    };
    p.x = as(bf.x);
    p.weight = as(bf.weight);
    p.bias = as(*bf.bias);
    if constexpr (std::is_same_v<T, float>) p.x.as<float>()[0] = 0x1.234568p-3f;  // not a bf16 or f16 value
    return p;
  };
  for (const Problem& p : {converted(f16()), converted(0.0f)}) {
    const SafetensorsFile f = parse_safetensors(serialize_safetensors(problem_to_file(p)), "memory");
    for (const char* name : {"x", "weight", "bias"}) EXPECT_EQ(f.tensors.at(name).dtype, p.input_dtype()) << name;
    const Problem q = problem_from_file(f, "memory");
    EXPECT_EQ(q.input_dtype(), p.input_dtype());
    EXPECT_EQ(q.x, p.x);
    EXPECT_EQ(q.weight, p.weight);
    EXPECT_EQ(*q.bias, *p.bias);
    EXPECT_NO_THROW(validate(q));
  }
}

// A file may hold any input dtype per tensor; that they must agree is validate()'s rule, which names both.
TEST(ProblemFile, MixedInputDtypesAreRefusedNamingBoth) {
  SafetensorsFile f = problem_to_file(small_problem());
  f.tensors["weight"] = Tensor(DType::F32, {5, 4});
  const Problem p = problem_from_file(f, "in.safetensors");
  try {
    validate(p);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "x is BF16 but weight is F32");
  }
}

TEST(ProblemFile, WrongDtypeMissingTensorAndDisagreeingShapesAreNamed) {
  auto message = [](const SafetensorsFile& f) -> std::string {
    try {
      problem_from_file(f, "in.safetensors");
    } catch (const InputError& e) {
      return e.what();
    }
    ADD_FAILURE() << "accepted";
    return "";
  };
  SafetensorsFile f = problem_to_file(small_problem());
  f.tensors["x"] = Tensor(DType::F64, {2, 3, 4});
  EXPECT_CONTAINS(message(f), "x is F64, SPEC says BF16, F16 or F32");
  f.tensors["x"] = Tensor(DType::F32, {2, 3, 4});
  f.tensors["target"] = Tensor(DType::BF16, {2, 3});
  EXPECT_CONTAINS(message(f), "target is BF16, SPEC says I64");

  f = problem_to_file(small_problem());
  f.tensors.erase("target");
  EXPECT_CONTAINS(message(f), "\"target\"");

  f = problem_to_file(small_problem());
  f.tensors["weight"] = Tensor(DType::BF16, {5, 6});  // H = 6 against x's H = 4
  std::string m = message(f);
  EXPECT_CONTAINS(m, "[2, 3, 4]");
  EXPECT_CONTAINS(m, "[5, 6]");

  f = problem_to_file(small_problem());
  f.tensors["bias"] = Tensor(DType::BF16, {7});
  m = message(f);
  EXPECT_CONTAINS(m, "[5, 4]");
  EXPECT_CONTAINS(m, "[7]");

  f = problem_to_file(small_problem());
  f.tensors["grad_x"] = Tensor(DType::F64, {2, 3, 4});  // an outputs tensor in an inputs file
  EXPECT_CONTAINS(message(f), "\"grad_x\"");
}

TEST(OutputsFile, UnknownTensorNameIsNamed) {
  const auto dir = std::filesystem::temp_directory_path() / ("outputs_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "out.safetensors").string();
  TensorMap outputs;
  outputs["loss"] = Tensor::scalar<double>(0.75);
  outputs["grad_bias"] = Tensor(DType::F32, {5});
  save_outputs(path, outputs, {{"impl", "test"}});
  const TensorMap back = load_outputs(path);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back.at("loss").value(0), 0.75);

  outputs["logits"] = Tensor(DType::F32, {5});
  save_outputs(path, outputs);
  try {
    load_outputs(path);
    ADD_FAILURE() << "unknown output accepted";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "\"logits\"");
    EXPECT_CONTAINS(e.what(), path);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace simpo
