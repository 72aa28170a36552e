// `--impl exec:COMMAND` (SPEC "External implementations"): both forms give results, refusals are InputErrors,
// and every fault is a failure with a message saying which fault, within the case timeout, never a hang; the
// program is restarted after a fault.
#include "verifier/exec_implementation.h"
#include "verifier/properties.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

namespace simpo::verifier {
namespace {

Problem small_problem() {
  CaseSpec spec;
  spec.shape = {2, 3, 4, 5};
  spec.seed = 3;
  return generate(spec);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Runs `command` (persistent unless it has {inputs}) on a small problem with a 1 s case timeout; returns the
// message of the fault it must raise, and checks it came within a few seconds.
std::string fault_of(const std::string& command) {
  ImplementationOptions options;
  options.case_timeout_s = 1;
  const Implementation impl = exec_implementation(command, options);
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)impl.compute(small_problem(), RunOptions{});
  } catch (const ImplementationFault& e) {
    EXPECT_LT(seconds_since(start), 5.0) << command;
    return e.what();
  }
  ADD_FAILURE() << command << ": no ImplementationFault";
  return "";
}

#define EXPECT_CONTAINS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// The shell snippets pull "inputs" and "outputs" out of the request line (nlohmann writes it compactly, keys sorted).
const std::string read_paths = R"sh(i=$(echo "$l" | sed 's/.*"inputs":"\([^"]*\)".*/\1/'); o=$(echo "$l" | sed 's/.*"outputs":"\([^"]*\)".*/\1/'); )sh";

TEST(Exec, SleepsForeverIsKilledAtTheCaseTimeout) {
  EXPECT_CONTAINS(fault_of("sleep 1000"), "did not answer within the case timeout of 1 s");
  EXPECT_CONTAINS(fault_of("read l; sleep 1000"), "did not answer within the case timeout");
  EXPECT_CONTAINS(fault_of("sleep 1000 # one-shot {inputs}"), "did not answer within the case timeout");
}

TEST(Exec, ExitsAtOnceIsADeath) {
  EXPECT_CONTAINS(fault_of("exit 0"), "died");
  EXPECT_CONTAINS(fault_of("read l; kill -9 $$"), "died without answering (killed by signal 9");
  EXPECT_CONTAINS(fault_of("kill -9 $$ # {inputs}"), "died (killed by signal 9");
}

TEST(Exec, GarbageOnStdoutIsNamed) {
  EXPECT_CONTAINS(fault_of("while read l; do echo 'loss = 0.5'; done"),
                  "printed something other than a JSON answer {\"ok\": ...} on standard output: \"loss = 0.5\"");
  EXPECT_CONTAINS(fault_of("while read l; do echo debug; echo '{\"ok\": true}'; done"), "printed something other than a JSON answer");
}

TEST(Exec, HalfAFileIsMalformed) {
  // Writes the first half of a valid safetensors file (its inputs) as its outputs and says ok.
  const std::string half = "while read l; do " + read_paths +
                           R"sh(head -c $(( $(wc -c < "$i") / 2 )) "$i" > "$o"; echo '{"ok": true}'; done)sh";
  EXPECT_CONTAINS(fault_of(half), "wrote a malformed outputs file");
  EXPECT_CONTAINS(fault_of("while read l; do echo '{\"ok\": true}'; done"), "but wrote no outputs file");
  EXPECT_CONTAINS(fault_of("true {inputs}"), "exited with status 0 but wrote no outputs file");
}

TEST(Exec, RefusalsAreInputErrorsWithTheProgramsMessage) {
  const Implementation persistent = exec_implementation("while read l; do echo '{\"ok\": false, \"error\": \"B must be 4\"}'; done");
  try {
    (void)persistent.compute(small_problem(), RunOptions{});
    FAIL() << "no refusal";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "B must be 4");
  }
  const Implementation one_shot = exec_implementation("echo 'V too small' >&2; exit 1 # {inputs}");
  try {
    (void)one_shot.compute(small_problem(), RunOptions{});
    FAIL() << "no refusal";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "V too small");
  }
}

TEST(Exec, RestartedAfterAFault) {
  const std::string marker = (std::filesystem::temp_directory_path() / ("simpo-exec-test-" + std::to_string(::getpid()))).string();
  std::filesystem::remove(marker);
  // First life: dies on its first case. Second life: refuses every case (so it answered: it was restarted).
  const Implementation impl = exec_implementation(
      "if [ ! -e " + marker + " ]; then touch " + marker + "; exit 1; fi; while read l; do echo '{\"ok\": false, \"error\": \"second life\"}'; done");
  EXPECT_THROW((void)impl.compute(small_problem(), RunOptions{}), ImplementationFault);
  try {
    (void)impl.compute(small_problem(), RunOptions{});
    ADD_FAILURE() << "no answer from the restarted program";
  } catch (const InputError& e) {
    EXPECT_CONTAINS(e.what(), "second life");
  }
  std::filesystem::remove(marker);
}

TEST(Exec, ASweepOfAHangingProgramEndsAndFailsEveryCase) {
  ImplementationOptions options;
  options.case_timeout_s = 0.5;
  SweepOptions sweep;
  sweep.max_cases = 3;
  sweep.time_budget_s = 0;
  sweep.shrink = false;
  const auto start = std::chrono::steady_clock::now();
  const SweepResult r = run_sweep(exec_implementation("sleep 1000", options), sweep);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(r.cases, 3);
  ASSERT_EQ(r.failures.size(), 3u);
  EXPECT_CONTAINS(r.failures[0].outcome.detail, "did not answer within the case timeout");
}

// The one-shot form end to end: simpo-verify compute --impl cpu as an external program. It passes the sweep;
// chunking_invariant is skipped (an external program cannot be given chunk caps), and the table says so.
TEST(Exec, OneShotFormPassesTheSweep) {
  const std::string cli = SIMPO_VERIFY_CLI;
  const Implementation impl = exec_implementation(
      "if [ {gradients} = true ]; then g=; else g=--no-grad; fi; " + cli +
      " compute --impl cpu --inputs {inputs} --out {outputs} $g 2>/dev/null");
  EXPECT_FALSE(impl.takes_chunking);
  SweepOptions sweep;
  sweep.max_cases = 12;
  sweep.time_budget_s = 0;
  const SweepResult r = run_sweep(impl, sweep);
  for (const auto& ce : r.failures) ADD_FAILURE() << ce.outcome.property << ": " << ce.outcome.detail;
  EXPECT_GT(r.passed.at("matches_reference"), 0);
  EXPECT_EQ(r.passed.count("chunking_invariant"), 0u);
  EXPECT_EQ(r.skipped.at("chunking_invariant"), r.passed.at("matches_reference"));
  EXPECT_CONTAINS(format_sweep(r, impl.name), "skipped: chunking_invariant");
}

TEST(Exec, ReplayCommandsNameTheSameImplementation) {
  Case c;
  c.spec.shape = {2, 1, 1, 3};
  EXPECT_CONTAINS(c.case_command("exec:python3 my impl.py"), "--impl 'exec:python3 my impl.py'");
}

TEST(Exec, EmptyCommandOrBadTimeoutIsAnInputError) {
  EXPECT_THROW(implementation_by_name("exec:  "), InputError);
  ImplementationOptions bad;
  bad.case_timeout_s = 0;
  EXPECT_THROW(implementation_by_name("exec:true", bad), InputError);
}

}  // namespace
}  // namespace simpo::verifier
