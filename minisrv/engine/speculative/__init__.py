"""Speculative decoding's draft proposers: each proposes tokens for the target model to verify in one forward."""
