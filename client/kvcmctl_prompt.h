// kvcmctl's commands about one prompt (kvcmctl_prompt.cc): each Define* declares a
// command's flags, each Run* runs it.
#ifndef KVCM_CLIENT_KVCMCTL_PROMPT_H_
#define KVCM_CLIENT_KVCMCTL_PROMPT_H_

#include "client/cli_args.h"
#include "client/kvcmctl_command.h"

namespace kvcm::cli {

void DefineMatch(FlagSet& f);
int RunMatch(const Invocation& in);
void DefineRoute(FlagSet& f);
int RunRoute(const Invocation& in);
void DefineInsert(FlagSet& f);
int RunInsert(const Invocation& in);
void DefineFetch(FlagSet& f);
int RunFetch(const Invocation& in);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_KVCMCTL_PROMPT_H_
