//! Unit tests: loading errors, incremental decoding, chat rendering. The
//! equality with HF and llama.cpp is tests/tokenizer.rs (fixtures).
