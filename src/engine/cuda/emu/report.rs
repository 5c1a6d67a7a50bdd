//! What the emulator reports: a fault (the kernel, block and thread that
//! made it, read or write, and where: a buffer and byte offset), a damaged
//! canary found after a launch, a kernel error (deadlock, bad shuffle), or a
//! launch refused before it runs (unknown kernel, arguments that do not match
//! the signature). A separate file only to keep `mod.rs` readable.

/// Read, write, or (off x86-64) either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    Unknown,
}

/// Where a bad address is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// In (the guard regions of) buffer `buffer` of `bytes` bytes, at byte
    /// `offset` from its start (negative: before it; >= bytes: past its end).
    Buffer { buffer: String, bytes: usize, offset: i64 },
    /// Outside every emulator allocation (a wild pointer, or a fiber stack overflow).
    Wild { addr: u64 },
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Buffer { buffer, bytes, offset } => {
                let rel = if *offset < 0 {
                    format!("{} bytes before its start", -offset)
                } else if *offset as usize == *bytes {
                    "the first byte past its end".to_string()
                } else if *offset as usize > *bytes {
                    format!("{} bytes past its end", *offset as usize - bytes)
                } else {
                    "inside it".to_string()
                };
                write!(f, "byte offset {offset} of buffer `{buffer}` ({bytes} bytes; {rel})")
            }
            Location::Wild { addr } => write!(f, "address {addr:#x}, outside every emulator allocation"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EmuError {
    #[error("no emulated kernel `{0}` (build.rs compiles those listed in compile.rs, and the planted variants)")]
    UnknownKernel(String),
    #[error("kernel `{kernel}` takes ({signature}): {msg}")]
    Arguments {
        kernel: String,
        signature: String,
        msg: String,
    },
    #[error("kernel `{kernel}`: block ({},{},{}) thread ({},{},{}) {} out of bounds at {location}",
            block.0, block.1, block.2, thread.0, thread.1, thread.2,
            match access { Access::Read => "read", Access::Write => "wrote", Access::Unknown => "accessed" })]
    Fault {
        kernel: String,
        block: (u32, u32, u32),
        thread: (u32, u32, u32),
        access: Access,
        location: Location,
    },
    #[error("kernel `{kernel}` wrote out of bounds at {location} (found in the canary after the launch)")]
    Guard { kernel: String, location: Location },
    #[error("kernel `{kernel}`: {msg}")]
    Kernel { kernel: String, msg: String },
}
