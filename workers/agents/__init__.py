"""Agentic RL: multi-turn episodes in which the policy calls tools or talks to an
environment, trained token-exact on what the engine generated (docs/guides/agentic.md)."""
