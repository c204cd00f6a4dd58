// Megatron's tokenizer and data flags, shared by train, preprocess and generate.
#pragma once
#include <memory>

#include "apps/args.h"
#include "moecore/data/tokenizer.h"

namespace moecore::apps {
void add_tokenizer_flags(Args& a);
std::unique_ptr<data::Tokenizer> tokenizer_from(const Args& a);  // Error when --tokenizer-type is missing
// Megatron's vocabulary padding: the tokenizer's size rounded up to --make-vocab-size-divisible-by x the
// tensor-parallel size (each rank's vocabulary rows stay a multiple of it).
int64_t padded_vocab_size(const data::Tokenizer& tok, const Args& a, int64_t tp = 1);
}  // namespace moecore::apps
