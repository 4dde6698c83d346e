#include "client/cli_args.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "client/cli_inputs.h"
#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm::cli {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Lt;

FlagSet TestFlags() {
  FlagSet f;
  f.AddString("name", "x", "a string");
  f.AddInt("delta", -1, "an int");
  f.AddUint("count", 7, "a uint");
  f.AddBool("pin", "a bool");
  return f;
}

TEST(FlagSetTest, DefaultsWhenNothingIsGiven) {
  FlagSet f = TestFlags();
  ASSERT_TRUE(f.ParseAll({}).ok());
  EXPECT_EQ(f.GetString("name"), "x");
  EXPECT_EQ(f.GetInt("delta"), -1);
  EXPECT_EQ(f.GetUint("count"), 7u);
  EXPECT_FALSE(f.GetBool("pin"));
  EXPECT_FALSE(f.IsSet("name"));
}

TEST(FlagSetTest, AcceptsEqualsSpaceAndBareBooleans) {
  FlagSet f = TestFlags();
  std::vector<absl::string_view> args = {"--name=a=b", "--delta", "-5", "--count=12", "--pin"};
  ASSERT_TRUE(f.ParseAll(args).ok());
  EXPECT_EQ(f.GetString("name"), "a=b");
  EXPECT_EQ(f.GetInt("delta"), -5);
  EXPECT_EQ(f.GetUint("count"), 12u);
  EXPECT_TRUE(f.GetBool("pin"));
  EXPECT_TRUE(f.IsSet("count"));

  FlagSet g = TestFlags();
  std::vector<absl::string_view> off = {"--pin=false"};
  ASSERT_TRUE(g.ParseAll(off).ok());
  EXPECT_FALSE(g.GetBool("pin"));
  EXPECT_TRUE(g.IsSet("pin"));
}

TEST(FlagSetTest, ErrorsNameTheFlag) {
  const std::vector<std::pair<std::vector<absl::string_view>, std::string>> cases = {
      {{"--nope=1"}, "unknown flag --nope"},
      {{"--count=-3"}, "--count"},
      {{"--count=abc"}, "--count"},
      {{"--delta=1.5"}, "--delta"},
      {{"--pin=maybe"}, "--pin"},
      {{"--name"}, "--name: missing value"},
      {{"stray"}, "unexpected argument 'stray'"},
  };
  for (const auto& [args, message] : cases) {
    FlagSet f = TestFlags();
    absl::Status s = f.ParseAll(args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(s.message(), HasSubstr(message));
  }
}

TEST(FlagSetTest, ParsePrefixStopsAtTheCommand) {
  FlagSet f = TestFlags();
  std::vector<absl::string_view> args = {"--count=3", "match", "--name=y"};
  absl::StatusOr<size_t> consumed = f.ParsePrefix(args);
  ASSERT_TRUE(consumed.ok());
  EXPECT_EQ(*consumed, 1u);
  EXPECT_EQ(f.GetString("name"), "x");
}

TEST(FlagSetTest, HelpListsEveryFlagWithItsDefault) {
  const std::string help = TestFlags().Help();
  EXPECT_THAT(help, HasSubstr("--name=<string>"));
  EXPECT_THAT(help, HasSubstr("(default: 7)"));
  EXPECT_THAT(help, HasSubstr("--pin "));
}

TEST(TokenListTest, CommasAndWhitespaceSeparate) {
  absl::StatusOr<std::vector<int32_t>> t = ParseTokenList("1,2, 3\n4\t5,,");
  ASSERT_TRUE(t.ok());
  EXPECT_THAT(*t, ElementsAre(1, 2, 3, 4, 5));
  EXPECT_TRUE(ParseTokenList("").ok());
  EXPECT_EQ(ParseTokenList("1,-2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTokenList("1,2147483648").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTokenList("1,x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTokenFile("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

TEST(TokenListTest, RandomTokensAreReproducibleAndInRange) {
  const std::vector<int32_t> a = RandomTokens(1000, 42, 50);
  EXPECT_EQ(a, RandomTokens(1000, 42, 50));
  EXPECT_NE(a, RandomTokens(1000, 43, 50));
  EXPECT_THAT(a, Each(Lt(50)));
  EXPECT_THAT(RandomTokens(3, 1, 1u << 31), Each(::testing::Ge(0)));
  // SplitMix64 from seed 0 starts 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f
  // (the reference sequence); the CLI promises equal prompts for equal seeds on every build.
  EXPECT_THAT(RandomTokens(3, 0, 1000), ElementsAre(535, 700, 679));
}

TEST(TokenListTest, Uint32List) {
  absl::StatusOr<std::vector<uint32_t>> ids = ParseUint32List("0, 4294967295");
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre(0u, 4294967295u));
  EXPECT_FALSE(ParseUint32List("4294967296").ok());
  EXPECT_FALSE(ParseUint32List("-1").ok());
}

TEST(CliInputsTest, EnumSpellingsRoundTrip) {
  for (absl::string_view name : {"mla", "gqa", "mha", "mqa"}) {
    absl::StatusOr<AttentionKind> kind = ParseAttention(name);
    ASSERT_TRUE(kind.ok()) << name;
    EXPECT_EQ(AttentionName(*kind), name);
  }
  for (absl::string_view name : {"bf16", "fp16", "fp8", "int8"}) {
    absl::StatusOr<KvDtype> dtype = ParseDtype(name);
    ASSERT_TRUE(dtype.ok()) << name;
    EXPECT_EQ(DtypeName(*dtype), name);
  }
  EXPECT_EQ(*ParseTier("host"), Tier::kHost);
  EXPECT_THAT(ParseTier("ssd", "--tier").status().message(),
              HasSubstr("--tier: expected gpu|host|disk"));
  EXPECT_THAT(ParseDtype("fp4", "--dtype").status().message(), HasSubstr("--dtype"));
}

TEST(CliInputsTest, ModelSpecFromFlags) {
  FlagSet f;
  DefineModelSpec(f);
  std::vector<absl::string_view> args = {"--attention=mla",    "--layers=61",   "--heads=128",
                                         "--kv_lora_rank=512", "--rope_dim=64", "--page_size=16"};
  ASSERT_TRUE(f.ParseAll(args).ok());
  absl::StatusOr<ModelSpec> spec = ModelSpecFrom(f);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->Validate().ok());
  EXPECT_EQ(spec->BytesPerToken(), 70'272u);
  EXPECT_EQ(spec->page_size_tokens, 16u);

  // MHA defaults kv_heads to heads, MQA to 1.
  FlagSet mha;
  DefineModelSpec(mha);
  std::vector<absl::string_view> mha_args = {"--attention=mha", "--heads=32", "--layers=2",
                                             "--head_dim=128"};
  ASSERT_TRUE(mha.ParseAll(mha_args).ok());
  EXPECT_EQ(ModelSpecFrom(mha)->num_kv_heads, 32u);
  FlagSet mqa;
  DefineModelSpec(mqa);
  std::vector<absl::string_view> mqa_args = {"--attention=mqa", "--heads=32"};
  ASSERT_TRUE(mqa.ParseAll(mqa_args).ok());
  EXPECT_EQ(ModelSpecFrom(mqa)->num_kv_heads, 1u);

  FlagSet big;
  DefineModelSpec(big);
  std::vector<absl::string_view> big_args = {"--num_layers=4294967296"};
  ASSERT_TRUE(big.ParseAll(big_args).ok());
  EXPECT_THAT(ModelSpecFrom(big).status().message(), HasSubstr("--num_layers"));
}

TEST(CliInputsTest, ModelSpecFromPresetWithOverrides) {
  auto spec_from = [](std::vector<absl::string_view> args) {
    FlagSet f;
    DefineModelSpec(f);
    EXPECT_TRUE(f.ParseAll(args).ok());
    return ModelSpecFrom(f);
  };
  absl::StatusOr<ModelSpec> v3 = spec_from({"--preset=deepseek-v3"});
  ASSERT_TRUE(v3.ok()) << v3.status();
  EXPECT_EQ(*v3, *FindModel("deepseek-v3"));
  EXPECT_EQ(v3->BytesPerToken(), 70'272u);

  // --dtype picks the catalogue dtype (FP8 MLA: 656 B * 61 layers); other flags override.
  absl::StatusOr<ModelSpec> fp8 = spec_from({"--preset=deepseek-v3", "--dtype=fp8"});
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ(fp8->BytesPerToken(), 40'016u);
  absl::StatusOr<ModelSpec> short_llama =
      spec_from({"--preset=llama-3-8b", "--layers=16", "--page_size=16"});
  ASSERT_TRUE(short_llama.ok()) << short_llama.status();
  EXPECT_EQ(short_llama->num_layers, 16u);
  EXPECT_EQ(short_llama->num_kv_heads, 8u);  // kept from the catalogue
  EXPECT_EQ(short_llama->page_size_tokens, 16u);
  EXPECT_EQ(short_llama->BytesPerToken(), 4'096u * 16);

  // --kv_layout names a page's byte layout (the catalogue states none); a bad one fails
  // the spec's validation, naming the field.
  const char* kLayout = "--kv_layout=vllm/CPU_MLA:bf16:block[1,16,576]:order[1,2]";
  absl::StatusOr<ModelSpec> laid_out = spec_from({"--preset=deepseek-v3", kLayout});
  ASSERT_TRUE(laid_out.ok()) << laid_out.status();
  EXPECT_EQ(laid_out->kv_layout, "vllm/CPU_MLA:bf16:block[1,16,576]:order[1,2]");
  EXPECT_TRUE(laid_out->Validate().ok());
  EXPECT_EQ(v3->kv_layout, "");
  absl::StatusOr<ModelSpec> junk = spec_from({"--preset=deepseek-v3", "--kv_layout=bad\x01"});
  ASSERT_TRUE(junk.ok());
  EXPECT_THAT(junk->Validate().message(), HasSubstr("kv_layout"));

  // An MHA preset's kv_heads follow an overridden --heads.
  absl::StatusOr<ModelSpec> wide = spec_from({"--preset=llama-2-7b", "--heads=40"});
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(wide->num_kv_heads, 40u);

  absl::StatusOr<ModelSpec> unknown = spec_from({"--preset=gpt-5"});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("--preset"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("deepseek-v3"));
}

TEST(CliInputsTest, ExactlyOneTokenSource) {
  auto tokens = [](std::vector<absl::string_view> args) {
    FlagSet f;
    DefineTokens(f);
    EXPECT_TRUE(f.ParseAll(args).ok());
    return TokensFrom(f);
  };
  EXPECT_THAT(*tokens({"--tokens=4,5"}), ElementsAre(4, 5));
  EXPECT_EQ(tokens({"--random_tokens=10", "--seed=3"})->size(), 10u);
  EXPECT_EQ(*tokens({"--random_tokens=10", "--seed=3"}), RandomTokens(10, 3, 32000));
  EXPECT_FALSE(tokens({}).ok());
  EXPECT_FALSE(tokens({"--tokens=1", "--random_tokens=2"}).ok());
  EXPECT_FALSE(tokens({"--random_tokens=2", "--vocab=0"}).ok());

  FlagSet ns;
  DefineNamespace(ns);
  std::vector<absl::string_view> only_tenant = {"--tenant=a"};
  ASSERT_TRUE(ns.ParseAll(only_tenant).ok());
  EXPECT_THAT(NamespaceFrom(ns).status().message(), HasSubstr("--model is required"));
}

TEST(CliInputsTest, SecurityFlags) {
  auto security = [](std::vector<absl::string_view> args, const char* env = nullptr) {
    FlagSet f;
    DefineSecurity(f);
    EXPECT_TRUE(f.ParseAll(args).ok());
    return SecurityFrom(f, env);
  };
  absl::StatusOr<Security> plain = security({"--insecure"});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->tls.insecure);
  EXPECT_EQ(plain->token, "");

  absl::StatusOr<Security> tls = security({"--ca=ca.pem", "--cert=c.pem", "--key=c.key"});
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_FALSE(tls->tls.insecure);
  EXPECT_EQ(tls->tls.ca_file, "ca.pem");
  EXPECT_EQ(tls->tls.cert_file, "c.pem");
  EXPECT_EQ(tls->tls.key_file, "c.key");
  EXPECT_TRUE(tls->tls.ValidateForChannel().ok());

  EXPECT_THAT(security({}).status().message(), HasSubstr("--tls_ca_file is required"));
  EXPECT_THAT(security({"--insecure", "--tls_ca_file=ca.pem"}).status().message(),
              HasSubstr("--insecure excludes"));
  EXPECT_THAT(security({"--tls_ca_file=ca.pem", "--tls_cert_file=c.pem"}).status().message(),
              HasSubstr("--tls_cert_file and --tls_key_file go together"));

  // The token: --token_file or --token, else the environment.
  EXPECT_EQ(security({"--insecure", "--token=t1"}, "env")->token, "t1");
  EXPECT_EQ(security({"--insecure"}, "from-env")->token, "from-env");
  EXPECT_EQ(security({"--insecure"}, "")->token, "");
  const std::string path = ::testing::TempDir() + "/cli_token";
  std::ofstream(path) << "from-file\n";
  const std::string file_flag = "--token_file=" + path;
  EXPECT_EQ(security({"--insecure", file_flag}, "env")->token, "from-file");
  EXPECT_THAT(security({"--insecure", file_flag, "--token=t"}).status().message(),
              HasSubstr("one of --token and --token_file"));
  EXPECT_THAT(security({"--insecure", "--token_file=/nonexistent"}).status().message(),
              HasSubstr("--token_file \"/nonexistent\""));
  EXPECT_THAT(security({"--insecure", "--token=a b"}).status().message(), HasSubstr("--token"));
  EXPECT_THAT(security({"--insecure"}, "bad token").status().message(), HasSubstr("KVCM_TOKEN"));
  std::remove(path.c_str());
}

TEST(FlagSetTest, DeprecatedAliasSetsTheNewFlagAndWarnsOnce) {
  FlagSet f = TestFlags();
  f.AddDeprecatedAlias("n", "name");
  f.AddDeprecatedAlias("c", "count");
  EXPECT_THAT(f.Help(), HasSubstr("deprecated, still accepted: --n (--name), --c (--count)"));
  std::vector<absl::string_view> args = {"--n=a", "--n", "b", "--c=3", "--pin"};
  ASSERT_TRUE(f.ParseAll(args).ok());
  EXPECT_EQ(f.GetString("name"), "b");  // the last one wins, as with the new name
  EXPECT_TRUE(f.IsSet("name"));
  EXPECT_EQ(f.GetUint("count"), 3u);
  EXPECT_THAT(f.DeprecationWarnings(),
              ElementsAre("--n is deprecated; use --name", "--c is deprecated; use --count"));

  // The new name warns about nothing; an alias's bad value names the new flag.
  FlagSet g = TestFlags();
  g.AddDeprecatedAlias("c", "count");
  std::vector<absl::string_view> plain = {"--count=4"};
  ASSERT_TRUE(g.ParseAll(plain).ok());
  EXPECT_TRUE(g.DeprecationWarnings().empty());
  FlagSet h = TestFlags();
  h.AddDeprecatedAlias("c", "count");
  std::vector<absl::string_view> bad = {"--c=-1"};
  EXPECT_THAT(h.ParseAll(bad).message(), HasSubstr("--count"));
}

TEST(CliInputsTest, OldModelAndTlsFlagNamesStillWork) {
  FlagSet f;
  DefineModelSpec(f);
  std::vector<absl::string_view> old_args = {"--attention=gqa", "--layers=2",   "--heads=8",
                                             "--kv_heads=2",    "--head_dim=4", "--dtype=fp8",
                                             "--page_size=16"};
  ASSERT_TRUE(f.ParseAll(old_args).ok());
  FlagSet g;
  DefineModelSpec(g);
  std::vector<absl::string_view> new_args = {
      "--attention=gqa", "--num_layers=2", "--num_heads=8",        "--num_kv_heads=2",
      "--head_dim=4",    "--kv_dtype=fp8", "--page_size_tokens=16"};
  ASSERT_TRUE(g.ParseAll(new_args).ok());
  ASSERT_TRUE(ModelSpecFrom(f).ok());
  EXPECT_EQ(*ModelSpecFrom(f), *ModelSpecFrom(g));
  EXPECT_EQ(f.DeprecationWarnings().size(), 5u);
  EXPECT_TRUE(g.DeprecationWarnings().empty());

  FlagSet tls;
  DefineSecurity(tls);
  std::vector<absl::string_view> tls_args = {"--ca=ca.pem", "--cert=c.pem", "--key=c.key"};
  ASSERT_TRUE(tls.ParseAll(tls_args).ok());
  absl::StatusOr<Security> security = SecurityFrom(tls, nullptr);
  ASSERT_TRUE(security.ok()) << security.status();
  EXPECT_EQ(security->tls.ca_file, "ca.pem");
  EXPECT_EQ(security->tls.cert_file, "c.pem");
  EXPECT_EQ(security->tls.key_file, "c.key");
  EXPECT_THAT(tls.DeprecationWarnings(), ElementsAre("--ca is deprecated; use --tls_ca_file",
                                                     "--cert is deprecated; use --tls_cert_file",
                                                     "--key is deprecated; use --tls_key_file"));
}

TEST(CheckHostPortTest, AcceptsHostPortAndSchemes) {
  for (absl::string_view ok : {"localhost:50051", "127.0.0.1:1", "[::1]:50051", "kvcm:65535",
                               "dns:///kvcm:50051", "unix:/tmp/kvcm.sock", "ipv4:10.0.0.1:5"}) {
    EXPECT_TRUE(CheckHostPort("manager_address", ok, "the manager", 50051).ok()) << ok;
  }
}

TEST(CheckHostPortTest, NamesTheFlagAndTheFix) {
  absl::Status s = CheckHostPort("manager_address", "localhost", "the manager", 50051);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "--manager_address 'localhost' has no port; the manager listens on 50051 by "
            "default: localhost:50051");
  EXPECT_THAT(CheckHostPort("agent_address", "gpu-0:", "the agent", 50052).message(),
              HasSubstr("gpu-0:50052"));
  EXPECT_THAT(CheckHostPort("agent_address", "[::1]", "the agent", 50052).message(),
              HasSubstr("[::1]:50052"));
  EXPECT_THAT(CheckHostPort("manager_address", "::1", "the manager", 50051).message(),
              HasSubstr("[::1]:50051"));
  for (absl::string_view bad : {"h:0", "h:65536", "h:x", ":50051", "[::1", "[::1]x"}) {
    absl::Status b = CheckHostPort("manager_address", bad, "the manager", 50051);
    EXPECT_EQ(b.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(b.message(), HasSubstr("--manager_address")) << bad;
  }
  EXPECT_THAT(CheckHostPort("manager_address", "", "the manager", 50051).message(),
              HasSubstr("empty"));
}

}  // namespace
}  // namespace kvcm::cli
