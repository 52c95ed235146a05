// The subcommands, one function each (src/cli/<command>.cpp). Each gets the
// arguments after its name and returns the process exit code; errors are thrown as
// mt::Error and printed by main().
#pragma once

#include "cli/args.h"

namespace mt::cli {

int run_train(const Args& args);
int run_eval(const Args& args);
int run_encode(const Args& args);
int run_tokenize(const Args& args);
int run_export_hf(const Args& args);
int run_plan(const Args& args);
int run_generate(const Args& args);

}  // namespace mt::cli
