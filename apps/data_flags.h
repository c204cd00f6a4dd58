// Megatron's tokenizer and data flags, shared by train, preprocess and generate.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "apps/args.h"
#include "moecore/data/tokenizer.h"

namespace moecore::apps {
void add_tokenizer_flags(Args& a);
std::unique_ptr<data::Tokenizer> tokenizer_from(const Args& a);  // Error when --tokenizer-type is missing
// Megatron's vocabulary padding: the tokenizer's size rounded up to --make-vocab-size-divisible-by x the
// tensor-parallel size (each rank's vocabulary rows stay a multiple of it).
int64_t padded_vocab_size(const data::Tokenizer& tok, const Args& a, int64_t tp = 1);
// The token ids a sample starts from (generate --prompt, train --prompt with --generate-tokens): the prompt's. An
// empty prompt (or one that encodes to no token) starts from the end-of-document token, which ends every document of
// the training data (Megatron's preprocessing), so the sample is a new document: unconditional sampling, as GPT-2
// does from <|endoftext|>. The token itself is not printed.
std::vector<int32_t> prompt_tokens(const data::Tokenizer& tok, const std::string& prompt);
}  // namespace moecore::apps
