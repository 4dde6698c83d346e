#include "client/cli_args.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvcm::cli {

FlagSet::Flag FlagSet::NewFlag(Kind kind, std::string help, std::string default_text) {
  Flag flag;
  flag.kind = kind;
  flag.help = std::move(help);
  flag.default_text = std::move(default_text);
  return flag;
}

void FlagSet::Add(std::string name, Flag flag) {
  order_.push_back(name);
  flags_.emplace(std::move(name), std::move(flag));
}

void FlagSet::AddString(std::string name, std::string default_value, std::string help) {
  Flag flag = NewFlag(Kind::kString, std::move(help), default_value);
  flag.string_value = std::move(default_value);
  Add(std::move(name), std::move(flag));
}

void FlagSet::AddInt(std::string name, int64_t default_value, std::string help) {
  Flag flag = NewFlag(Kind::kInt, std::move(help), absl::StrCat(default_value));
  flag.int_value = default_value;
  Add(std::move(name), std::move(flag));
}

void FlagSet::AddUint(std::string name, uint64_t default_value, std::string help) {
  Flag flag = NewFlag(Kind::kUint, std::move(help), absl::StrCat(default_value));
  flag.uint_value = default_value;
  Add(std::move(name), std::move(flag));
}

void FlagSet::AddBool(std::string name, std::string help) {
  Add(std::move(name), NewFlag(Kind::kBool, std::move(help), "false"));
}

void FlagSet::AddDeprecatedAlias(std::string old_name, std::string new_name) {
  alias_order_.push_back(old_name);
  aliases_.emplace(std::move(old_name), std::move(new_name));
}

absl::Status FlagSet::Assign(absl::string_view name, Flag& flag, absl::string_view value) {
  flag.set = true;
  switch (flag.kind) {
    case Kind::kString:
      flag.string_value.assign(value.data(), value.size());
      return absl::OkStatus();
    case Kind::kInt:
      if (!absl::SimpleAtoi(value, &flag.int_value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": expected an integer, got '", value, "'"));
      }
      return absl::OkStatus();
    case Kind::kUint:
      if (absl::StartsWith(value, "-") || !absl::SimpleAtoi(value, &flag.uint_value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": expected a non-negative integer, got '", value, "'"));
      }
      return absl::OkStatus();
    case Kind::kBool:
      if (value == "true" || value == "1") {
        flag.bool_value = true;
      } else if (value == "false" || value == "0") {
        flag.bool_value = false;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": expected true or false, got '", value, "'"));
      }
      return absl::OkStatus();
  }
  return absl::InternalError("unknown flag kind");
}

absl::StatusOr<size_t> FlagSet::ParsePrefix(std::span<const absl::string_view> args) {
  size_t i = 0;
  while (i < args.size()) {
    absl::string_view arg = args[i];
    if (arg == "--") {
      return i + 1;
    }
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return i;
    }
    arg.remove_prefix(2);
    const size_t eq = arg.find('=');
    absl::string_view name = arg.substr(0, eq);
    if (auto alias = aliases_.find(name); alias != aliases_.end()) {
      std::string warning =
          absl::StrCat("--", alias->first, " is deprecated; use --", alias->second);
      if (std::find(warnings_.begin(), warnings_.end(), warning) == warnings_.end()) {
        warnings_.push_back(std::move(warning));
      }
      name = alias->second;
    }
    auto it = flags_.find(name);
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    Flag& flag = it->second;
    ++i;
    if (eq != absl::string_view::npos) {
      if (absl::Status s = Assign(name, flag, arg.substr(eq + 1)); !s.ok()) {
        return s;
      }
    } else if (flag.kind == Kind::kBool) {
      flag.set = true;
      flag.bool_value = true;
    } else {
      if (i == args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      }
      if (absl::Status s = Assign(name, flag, args[i]); !s.ok()) {
        return s;
      }
      ++i;
    }
  }
  return i;
}

absl::Status FlagSet::ParseAll(std::span<const absl::string_view> args) {
  absl::StatusOr<size_t> consumed = ParsePrefix(args);
  if (!consumed.ok()) {
    return consumed.status();
  }
  if (*consumed < args.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args[*consumed], "'"));
  }
  return absl::OkStatus();
}

const FlagSet::Flag& FlagSet::Get(absl::string_view name, Kind kind) const {
  auto it = flags_.find(name);
  // Asking for an undeclared flag, or with the wrong type, is a bug in the caller.
  if (it == flags_.end() || it->second.kind != kind) {
    std::fprintf(stderr, "internal error: flag --%.*s is not declared with this type\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
  return it->second;
}

const std::string& FlagSet::GetString(absl::string_view name) const {
  return Get(name, Kind::kString).string_value;
}
int64_t FlagSet::GetInt(absl::string_view name) const { return Get(name, Kind::kInt).int_value; }
uint64_t FlagSet::GetUint(absl::string_view name) const {
  return Get(name, Kind::kUint).uint_value;
}
bool FlagSet::GetBool(absl::string_view name) const { return Get(name, Kind::kBool).bool_value; }

bool FlagSet::IsSet(absl::string_view name) const {
  auto it = flags_.find(name);
  return it != flags_.end() && it->second.set;
}

std::string FlagSet::Help() const {
  std::string out;
  for (const std::string& name : order_) {
    const Flag& flag = flags_.find(name)->second;
    absl::string_view type;
    switch (flag.kind) {
      case Kind::kString:
        type = "=<string>";
        break;
      case Kind::kInt:
        type = "=<int>";
        break;
      case Kind::kUint:
        type = "=<uint>";
        break;
      case Kind::kBool:
        type = "";
        break;
    }
    std::string left = absl::StrCat("--", name, type);
    absl::StrAppendFormat(&out, "  %-26s %s", left, flag.help);
    if (!flag.default_text.empty() && flag.kind != Kind::kBool) {
      absl::StrAppend(&out, " (default: ", flag.default_text, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  if (!alias_order_.empty()) {
    std::vector<std::string> pairs;
    for (const std::string& old_name : alias_order_) {
      pairs.push_back(absl::StrCat("--", old_name, " (--", aliases_.find(old_name)->second, ")"));
    }
    absl::StrAppend(&out, "  deprecated, still accepted: ", absl::StrJoin(pairs, ", "), "\n");
  }
  return out;
}

absl::Status CheckHostPort(absl::string_view flag, absl::string_view address,
                           absl::string_view server, int default_port) {
  if (absl::StrContains(address, "://") || absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "ipv4:") || absl::StartsWith(address, "ipv6:")) {
    return absl::OkStatus();  // a gRPC target with a scheme: gRPC parses it
  }
  if (address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty; ", server,
                                                   " listens on ", default_port,
                                                   " by default: 127.0.0.1:", default_port));
  }
  absl::string_view host = address;
  absl::string_view port;
  if (absl::StartsWith(address, "[")) {  // [v6]:port
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " '", address, "': an IPv6 address ends with ']'"));
    }
    host = address.substr(0, close + 1);
    if (close + 1 < address.size() && address[close + 1] == ':') {
      port = address.substr(close + 2);
    } else if (close + 1 != address.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " '", address, "': expected [address]:port"));
    }
  } else {
    const size_t colon = address.rfind(':');
    if (colon != absl::string_view::npos && address.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, " '", address, "': write an IPv6 address in brackets with its port: [",
          address, "]:", default_port));
    }
    if (colon != absl::string_view::npos) {
      host = address.substr(0, colon);
      port = address.substr(colon + 1);
    }
  }
  if (port.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " '", address, "' has no port; ",
                                                   server, " listens on ", default_port,
                                                   " by default: ", host, ":", default_port));
  }
  int value = 0;
  if (!absl::SimpleAtoi(port, &value) || value < 1 || value > 65535 || host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " '", address, "': expected host:port with a port in 1..65535"));
  }
  return absl::OkStatus();
}

namespace {

std::vector<absl::string_view> SplitIds(absl::string_view text) {
  return absl::StrSplit(text, absl::ByAnyChar(", \t\r\n"), absl::SkipEmpty());
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> ParseTokenList(absl::string_view text) {
  std::vector<int32_t> tokens;
  for (absl::string_view piece : SplitIds(text)) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(piece, &id) || id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token '", piece, "' is not an id in [0, 2^31)"));
    }
    tokens.push_back(id);
  }
  return tokens;
}

absl::StatusOr<std::vector<int32_t>> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open token file ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<int32_t>> tokens = ParseTokenList(text.str());
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tokens.status().message()));
  }
  return tokens;
}

std::vector<int32_t> RandomTokens(size_t count, uint64_t seed, uint32_t vocab) {
  std::vector<int32_t> tokens(count);
  uint64_t state = seed;
  for (int32_t& token : tokens) {
    state += 0x9e3779b97f4a7c15ULL;  // SplitMix64 (Steele, Lea, Flood 2014)
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    token = static_cast<int32_t>(z % vocab);
  }
  return tokens;
}

absl::StatusOr<std::vector<uint32_t>> ParseUint32List(absl::string_view text) {
  std::vector<uint32_t> ids;
  for (absl::string_view piece : SplitIds(text)) {
    uint32_t id = 0;
    if (absl::StartsWith(piece, "-") || !absl::SimpleAtoi(piece, &id)) {
      return absl::InvalidArgumentError(absl::StrCat("'", piece, "' is not a uint32"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace kvcm::cli
