// kvcmctl's commands about agents and their pools (kvcmctl_agent.cc): each Define* declares
// a command's flags, each Run* runs it.
#ifndef KVCM_CLIENT_KVCMCTL_AGENT_H_
#define KVCM_CLIENT_KVCMCTL_AGENT_H_

#include "client/cli_args.h"
#include "client/kvcmctl_command.h"

namespace kvcm::cli {

void DefineReserve(FlagSet& f);
int RunReserve(const Invocation& in);
void DefineUnreserve(FlagSet& f);
int RunUnreserve(const Invocation& in);
void DefineAgentStats(FlagSet& f);
int RunAgentStats(const Invocation& in);
void DefineLookupAgent(FlagSet& f);
int RunLookupAgent(const Invocation& in);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_KVCMCTL_AGENT_H_
