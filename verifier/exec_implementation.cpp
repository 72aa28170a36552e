#include "verifier/exec_implementation.h"

#include "problem/problem_io.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <spawn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

namespace simpo::verifier {

namespace {

using clock = std::chrono::steady_clock;

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "status " + std::to_string(status);
}

// At most `n` characters of s, printable, for messages.
std::string excerpt(const std::string& s, std::size_t n = 120) {
  std::string out;
  for (char ch : s.substr(0, n)) out += (ch >= 32 && ch < 127) ? ch : '?';
  if (s.size() > n) out += "...";
  return out;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Milliseconds left until `deadline` (0 when past), for poll().
int ms_left(clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<long long>(ms, 1 << 30));
}

// write() that neither raises SIGPIPE (a program that died has closed its stdin; SIGPIPE is blocked in this
// thread around the write and a pending one is consumed) nor blocks forever (poll with the deadline).
// Returns false when the reader is gone or the deadline passed.
bool write_all(int fd, const std::string& data, clock::time_point deadline) {
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  std::size_t done = 0;
  bool ok = true;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      if (poll(&p, 1, ms_left(deadline)) > 0) continue;
    }
    ok = false;
    break;
  }
  timespec zero{0, 0};
  sigset_t pending;
  sigpending(&pending);
  if (sigismember(&pending, SIGPIPE)) sigtimedwait(&pipe_set, nullptr, &zero);
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return ok;
}

// A child in its own process group, with pipes to its stdin and from its stdout or stderr.
struct Child {
  pid_t pid = -1;
  int to_stdin = -1;      // persistent form
  int from_output = -1;   // persistent: its stdout; one-shot: its stderr

  bool running() const { return pid > 0; }

  // Kills the whole process group (the shell and whatever it started) and reaps the shell.
  void kill_and_reap() {
    if (pid > 0) {
      ::kill(-pid, SIGKILL);
      int status;
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    close_fds();
    pid = -1;
  }
  void close_fds() {
    if (to_stdin >= 0) ::close(to_stdin);
    if (from_output >= 0) ::close(from_output);
    to_stdin = from_output = -1;
  }
  // Waits for the child to exit until the deadline; its status, or nothing (still running).
  std::optional<int> wait_until(clock::time_point deadline) {
    for (;;) {
      int status;
      const pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        ::kill(-pid, SIGKILL);  // anything it left behind in its group (the group outlives the leader's pid)
        pid = -1;
        close_fds();
        return status;
      }
      if (r < 0 && errno != EINTR) {
        pid = -1;
        close_fds();
        return 0;
      }
      if (clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
};

// Starts `/bin/sh -c command`. persistent: stdin and stdout are pipes, stderr passes through. one-shot: stdin is
// /dev/null, stdout goes to our stderr (it is not part of the protocol), stderr is a pipe (the refusal message).
Child spawn(const std::string& command, bool persistent) {
  int in[2] = {-1, -1}, out[2];
  if (persistent && pipe2(in, O_CLOEXEC) != 0) throw ImplementationFault(std::string("exec: pipe: ") + std::strerror(errno));
  if (pipe2(out, O_CLOEXEC) != 0) throw ImplementationFault(std::string("exec: pipe: ") + std::strerror(errno));
  const int devnull = persistent ? -1 : ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  // posix_spawn, not fork: glibc's posix_spawn runs no pthread_atfork handlers, and OpenBLAS's (which shuts its
  // worker threads down and joins them) deadlocked a fork made while another thread was inside a BLAS product
  // (`case` runs the reference beside the candidate). The child gets its own process group, so a timeout can
  // kill the whole tree.
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  if (persistent) {
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  } else {
    posix_spawn_file_actions_adddup2(&actions, devnull, 0);
    posix_spawn_file_actions_adddup2(&actions, 2, 1);
    posix_spawn_file_actions_adddup2(&actions, out[1], 2);
  }
  std::string sh = "sh", dash_c = "-c", text = command;
  char* argv[] = {sh.data(), dash_c.data(), text.data(), nullptr};
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, "/bin/sh", &actions, &attributes, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  if (spawned != 0) {
    for (const int fd : {in[0], in[1], out[0], out[1], devnull})
      if (fd >= 0) ::close(fd);
    throw ImplementationFault(std::string("exec: cannot start /bin/sh: ") + std::strerror(spawned));
  }
  setpgid(pid, pid);  // also here, so the group exists before we might signal it
  Child c;
  c.pid = pid;
  if (persistent) {
    ::close(in[0]);
    c.to_stdin = in[1];
    set_nonblocking(c.to_stdin);
  } else {
    ::close(devnull);
  }
  ::close(out[1]);
  c.from_output = out[0];
  set_nonblocking(c.from_output);
  return c;
}

class ExecDriver {
 public:
  ExecDriver(std::string command, ImplementationOptions options)
      : command_(std::move(command)), options_(options), one_shot_(command_.find("{inputs}") != std::string::npos) {
    std::string pattern = (std::filesystem::absolute(std::filesystem::temp_directory_path()) / "simpo-exec-XXXXXX").string();
    if (!mkdtemp(pattern.data())) throw InputError("exec: cannot create a temporary directory: " + std::string(std::strerror(errno)));
    dir_ = pattern;
    inputs_ = (std::filesystem::path(dir_) / "inputs.safetensors").string();
    outputs_ = (std::filesystem::path(dir_) / "outputs.safetensors").string();
  }
  ~ExecDriver() {
    if (child_.running()) {
      child_.close_fds();  // EOF on its stdin: SPEC says it exits
      if (!child_.wait_until(clock::now() + std::chrono::seconds(2))) child_.kill_and_reap();
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ExecDriver(const ExecDriver&) = delete;
  ExecDriver& operator=(const ExecDriver&) = delete;

  TensorMap run(const Problem& problem, const RunOptions& run) {
    std::error_code ec;
    std::filesystem::remove(outputs_, ec);
    save_problem(inputs_, problem);
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(options_.case_timeout_s));
    if (one_shot_)
      run_one_shot(run.gradients, deadline);
    else
      run_persistent(run.gradients, deadline);
    if (!std::filesystem::exists(outputs_)) fault(std::string(one_shot_ ? "exited with status 0" : "answered {\"ok\": true}") + " but wrote no outputs file (" + outputs_ + ")");
    try {
      return load_outputs(outputs_);
    } catch (const std::exception& e) {
      fault(std::string("wrote a malformed outputs file: ") + e.what());
    }
  }

 private:
  // SPEC: a fault fails the case and the program is restarted for the next one (its whole group killed now).
  [[noreturn]] void fault(const std::string& what) {
    child_.kill_and_reap();
    throw ImplementationFault("exec: the program " + what + (one_shot_ ? "" : "; restarted for the next case"));
  }

  // One read of the child's output that waits no later than the deadline (past it: a timeout fault). Returns
  // read(2)'s count: 0 at EOF, < 0 on an error other than EINTR/EAGAIN.
  ssize_t read_before(char* buffer, std::size_t size, clock::time_point deadline) {
    for (;;) {
      pollfd p{child_.from_output, POLLIN, 0};
      const int ready = poll(&p, 1, ms_left(deadline));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) fault(timeout_text());
      const ssize_t n = ::read(child_.from_output, buffer, size);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return n;
    }
  }

  std::string timeout_text() const {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", options_.case_timeout_s);
    return std::string("did not answer within the case timeout of ") + buf + " s (--case-timeout); killed";
  }

  // One line of the program's standard output, before the deadline (a fault otherwise).
  std::string read_line(clock::time_point deadline) {
    std::size_t newline;
    while ((newline = buffer_.find('\n')) == std::string::npos) {
      char chunk[4096];
      const ssize_t n = read_before(chunk, sizeof chunk, deadline);
      if (n <= 0) {  // EOF: it closed its stdout, which in practice means it died
        std::string why = "closed its standard output without answering";
        if (auto status = child_.wait_until(std::min(deadline, clock::now() + std::chrono::seconds(1))))
          why = "died without answering (" + describe_status(*status) + ")";
        if (!buffer_.empty()) why += "; it had printed \"" + excerpt(buffer_) + "\"";
        fault(why);
      }
      buffer_.append(chunk, static_cast<std::size_t>(n));
      if (buffer_.size() > (1 << 20)) fault("printed over 1 MiB on standard output without a newline: \"" + excerpt(buffer_) + "\"");
    }
    std::string line = buffer_.substr(0, newline);
    buffer_.erase(0, newline + 1);
    return line;
  }

 public:
  // SPEC's handshake, once, before the first case: {"capabilities": true}; an answer {"ok": true, "capabilities":
  // {...}} is the declaration, anything else (an older program's {"ok": false, ...}, garbage, dying) means all of
  // SPEC. A program that died or misbehaved here is restarted for the first case. A declaration that is present
  // but malformed is an InputError naming the key (the program says something wrong about itself).
  Capabilities capabilities() {
    if (declared_) return *declared_;
    declared_ = Capabilities{};
    if (one_shot_) return *declared_;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(options_.case_timeout_s));
    nlohmann::json answer;
    try {
      if (!child_.running()) {
        child_ = spawn(command_, true);
        buffer_.clear();
      }
      if (!write_all(child_.to_stdin, "{\"capabilities\": true}\n", deadline)) fault("stopped reading its standard input");
      answer = nlohmann::json::parse(read_line(deadline), nullptr, false);
    } catch (const ImplementationFault& e) {
      std::fprintf(stderr, "exec: no capabilities answer (%s): judged against all of SPEC\n", e.what());
      return *declared_;
    }
    if (answer.is_object() && answer.contains("ok") && answer["ok"] == true && answer.contains("capabilities"))
      declared_ = capabilities_from_json(answer["capabilities"].dump(), "exec: the program's capabilities answer");
    return *declared_;
  }

 private:
  void run_persistent(bool gradients, clock::time_point deadline) {
    if (!child_.running()) {
      child_ = spawn(command_, true);
      buffer_.clear();
    }
    const nlohmann::json request = {{"inputs", inputs_}, {"outputs", outputs_}, {"gradients", gradients}};
    if (!write_all(child_.to_stdin, request.dump() + "\n", deadline)) {
      if (auto status = child_.wait_until(clock::now() + std::chrono::milliseconds(200)))
        fault("died before reading the case (" + describe_status(*status) + ")");
      fault(clock::now() >= deadline ? timeout_text() : "stopped reading its standard input");
    }
    const std::string line = read_line(deadline);
    const nlohmann::json answer = nlohmann::json::parse(line, nullptr, false);
    if (answer.is_discarded() || !answer.is_object() || !answer.contains("ok") || !answer["ok"].is_boolean())
      fault("printed something other than a JSON answer {\"ok\": ...} on standard output: \"" + excerpt(line) + "\"");
    if (!trim(buffer_).empty())
      fault("printed more than one line for one case on standard output (stdout is the protocol; send logs to stderr): \"" +
            excerpt(buffer_) + "\"");
    if (!answer["ok"].get<bool>()) {
      const auto e = answer.find("error");
      throw InputError("exec: refused the inputs: " +
                       (e != answer.end() && e->is_string() ? e->get<std::string>() : std::string("(no error message)")));
    }
  }

  void run_one_shot(bool gradients, clock::time_point deadline) {
    std::string command = command_;
    auto replace = [&command](const std::string& key, const std::string& value) {
      for (std::size_t at; (at = command.find(key)) != std::string::npos;) command.replace(at, key.size(), value);
    };
    replace("{inputs}", shell_quote(inputs_));
    replace("{outputs}", shell_quote(outputs_));
    replace("{gradients}", gradients ? "true" : "false");
    child_ = spawn(command, false);
    std::string err;
    for (;;) {  // its stderr until EOF (it exited, or closed it)
      char chunk[4096];
      const ssize_t n = read_before(chunk, sizeof chunk, deadline);
      if (n <= 0) break;
      if (err.size() < (1 << 16)) err.append(chunk, static_cast<std::size_t>(n));
    }
    const auto status = child_.wait_until(deadline);
    if (!status) fault(timeout_text());
    if (WIFSIGNALED(*status)) fault("died (" + describe_status(*status) + ")" + (err.empty() ? "" : ": " + excerpt(trim(err), 400)));
    if (WEXITSTATUS(*status) != 0)
      throw InputError("exec: refused the inputs (" + describe_status(*status) + "): " +
                       (trim(err).empty() ? std::string("(nothing on stderr)") : excerpt(trim(err), 2000)));
    if (!err.empty()) std::fputs(err.c_str(), stderr);  // a successful run's stderr passes through
  }

  std::string command_;
  ImplementationOptions options_;
  bool one_shot_;
  std::string dir_, inputs_, outputs_;
  Child child_;
  std::string buffer_;  // what the program printed past its last answer
  std::optional<Capabilities> declared_;
};

}  // namespace

Implementation exec_implementation(const std::string& command, const ImplementationOptions& options) {
  validate(options);
  if (trim(command).empty()) throw InputError("--impl exec: needs a command after \"exec:\"");
  auto driver = std::make_shared<ExecDriver>(command, options);
  Implementation impl = make_implementation(
      "exec:" + command, [driver](const Problem& problem, const RunOptions& run) { return driver->run(problem, run); },
      /*takes_chunking=*/false);
  if (options.capabilities) {
    impl.capabilities = [declared = *options.capabilities] { return declared; };
  } else {
    impl.capabilities = [driver] { return driver->capabilities(); };
  }
  return impl;
}

}  // namespace simpo::verifier
