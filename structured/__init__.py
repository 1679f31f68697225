"""Structured outputs: a request's spec (JSON schema, regex, choice, grammar) compiled with
xgrammar into a matcher that says, token by token, which tokens may come next. The worker masks
logits with it; the gateway compiles each spec once, in a child process with a time bound, to
refuse a bad one before it reaches the scheduler. Knows no model: only a tokenizer's vocabulary."""
