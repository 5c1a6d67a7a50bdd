//! Any program as an engine: the subprocess protocol, version 1
//! (docs/testing-your-engine.md). touchstone starts the command once per spec
//! and keeps it for every run the checks need; requests go one JSON object per
//! line to its stdin, responses come one per line on its stdout, and its
//! stderr is its log, kept (the last 64 KiB) and shown with any failure.
//!
//! Nothing the engine does can hang or crash touchstone: every request has a
//! deadline (the reader is a thread; a late answer gets the process killed),
//! a response line is capped at 1 MiB, and an engine that exits, writes
//! something that is not JSON, answers out of protocol or writes an unusable
//! output file makes that request fail with the engine's name, the request
//! and its log. After a crash or a timeout the engine is marked dead and
//! later requests fail at once with the same reason.

use crate::arithmetic::Arithmetic;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use super::names::NameMap;
use super::{Engine, RunOutput, RunRequest, TapSet};
use crate::error::{Error, Result};
use crate::model::{LoadOptions, ModelConfig};

/// The protocol version this touchstone speaks.
pub const PROTOCOL: u64 = 1;
/// Default per-request deadline; a spec's `engines.NAME.timeout_s` overrides it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest response line accepted (a protocol response is a few bytes).
const MAX_LINE: usize = 1 << 20;
/// How much of the engine's stderr is kept.
const LOG_TAIL: usize = 64 << 10;

/// How to start a protocol engine.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecSpec {
    /// The name in trial ids and reports (`exec`, or the spec's engine name).
    pub name: String,
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// Working directory (a spec's engines run in the spec's folder).
    pub cwd: Option<PathBuf>,
    pub timeout: Duration,
    /// The arithmetic the spec declares for it (`engines: NAME: {arithmetic}`).
    pub arithmetic: Option<Arithmetic>,
    /// Its prerequisite probe (`engines: NAME: {requires}`; see `engine::requires`).
    pub requires: Option<Vec<String>>,
}

impl ExecSpec {
    /// `exec:COMMAND ARGS…` as typed on the command line (shell quoting rules).
    pub fn parse_cli(text: &str) -> std::result::Result<ExecSpec, String> {
        let argv = shlex::split(text).ok_or_else(|| format!("exec:{text}: unbalanced quotes"))?;
        if argv.is_empty() {
            return Err("exec: needs a command, e.g. --engine \"exec:python3 my_engine.py\"".into());
        }
        Ok(ExecSpec {
            name: "exec".into(),
            argv,
            cwd: None,
            timeout: DEFAULT_TIMEOUT,
            arithmetic: None,
            requires: None,
        })
    }

    /// Ok when it has no prerequisite or its probe passes (in its folder).
    pub fn prerequisites(&self) -> std::result::Result<(), String> {
        match &self.requires {
            Some(argv) => super::requires::probe(argv, self.cwd.as_deref()),
            None => Ok(()),
        }
    }

    /// The command as one line, for messages and rerun commands.
    pub fn command_line(&self) -> String {
        shlex::try_join(self.argv.iter().map(String::as_str)).unwrap_or_else(|_| self.argv.join(" "))
    }
}

/// The running process and the threads draining its output.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::result::Result<String, String>>,
    log: Arc<Mutex<Vec<u8>>>,
    /// Set once the process is unusable (exited, killed, out of protocol).
    dead: Option<String>,
}

pub struct ExecEngine {
    spec: ExecSpec,
    /// What it computes in, where its storage does not say it all: its load
    /// answer's `arithmetic`, else the spec's declaration.
    declared: Option<Arithmetic>,
    config: ModelConfig,
    /// The storage dtype the engine was asked to run in: every capture is
    /// tagged with it (or its file's dtype where that is coarser), as the
    /// built-in engines tag theirs, so golden tolerances follow the run.
    storage: crate::tensor::DType,
    names: NameMap,
    proc: Mutex<Proc>,
    /// Where run outputs are written (removed on drop).
    work: tempfile::TempDir,
    runs: std::sync::atomic::AtomicUsize,
    /// The stages its load answer says it can tap (every one by default).
    capabilities: super::capabilities::Capabilities,
    /// Its load answer says it answers `tokenize` requests.
    tokenizes: bool,
    /// The `memory_bytes` its last `run_batch` answer reported, if any.
    reported: Mutex<Option<u64>>,
}

impl ExecEngine {
    /// Starts the command and sends `load`.
    pub fn start(spec: &ExecSpec, model: &Path, opts: &LoadOptions, names: &NameMap) -> Result<ExecEngine> {
        let config = crate::model::read_config_with(model, opts.config.as_ref())?;
        let fail = |msg: String| Error::engine(&spec.name, msg);
        let mut cmd = Command::new(&spec.argv[0]);
        cmd.args(&spec.argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(d) = &spec.cwd {
            cmd.current_dir(d);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot start `{}`: {e}", spec.command_line())))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            loop {
                let mut buf = Vec::new();
                // Read at most MAX_LINE + 1 bytes of one line.
                match (&mut r).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf) {
                    Ok(0) => return, // EOF: the channel closes
                    Ok(_) if buf.len() > MAX_LINE => {
                        let _ = tx.send(Err(format!("a response line longer than {MAX_LINE} bytes")));
                        return;
                    }
                    Ok(_) => {
                        let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                        if tx.send(Ok(line)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("reading its stdout: {e}")));
                        return;
                    }
                }
            }
        });
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            let mut r = stderr;
            let mut chunk = [0u8; 8192];
            while let Ok(n) = r.read(&mut chunk) {
                if n == 0 {
                    return;
                }
                let mut l = sink.lock().unwrap_or_else(|p| p.into_inner());
                l.extend_from_slice(&chunk[..n]);
                if l.len() > LOG_TAIL {
                    let cut = l.len() - LOG_TAIL;
                    l.drain(..cut);
                }
            }
        });
        let work = tempfile::Builder::new()
            .prefix("touchstone-exec-")
            .tempdir()
            .map_err(|e| fail(format!("cannot create a folder for its outputs: {e}")))?;
        let mut engine = ExecEngine {
            spec: spec.clone(),
            declared: spec.arithmetic,
            config,
            storage: opts.storage,
            names: names.clone(),
            proc: Mutex::new(Proc {
                child,
                stdin,
                lines: rx,
                log,
                dead: None,
            }),
            work,
            runs: Default::default(),
            capabilities: Default::default(),
            reported: Mutex::new(None),
            tokenizes: false,
        };
        let model = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
        let mut load = json!({"op": "load", "protocol": PROTOCOL, "model": model, "storage": opts.storage.to_string()});
        // A spec's `config:` override goes with the model; an engine that
        // does not say it applied it would compute another model.
        if let Some(c) = &opts.config {
            load["config"] = c.clone();
        }
        let answer = engine.request("load", load)?;
        if opts.config.is_some() && answer.get("config").and_then(Value::as_bool) != Some(true) {
            return Err(fail(
                "the spec overrides the model's config (`config:`), and the engine's load answer does not say it \
                 applied the override (`\"config\": true`): refusing to check a model it may not compute"
                    .into(),
            ));
        }
        if let Some(n) = answer.get("engine").and_then(Value::as_str) {
            eprintln!("touchstone: engine `{}` is `{n}` ({})", spec.name, spec.command_line());
        }
        if let Some(a) = answer.get("arithmetic") {
            let a: Arithmetic = serde_json::from_value(a.clone()).map_err(|e| {
                fail(format!(
                    "its load answer's `arithmetic` is not one touchstone knows: {e}"
                ))
            })?;
            if let Some(d) = spec.arithmetic.filter(|d| *d != a) {
                return Err(fail(format!(
                    "the spec declares its arithmetic as {d}, but its load answer says {a}: they must agree"
                )));
            }
            engine.declared = Some(a);
        }
        engine.capabilities = super::capabilities::Capabilities::from_answer(&answer)
            .map_err(|e| fail(format!("its load answer's stage capabilities: {e}")))?;
        engine.tokenizes = match answer.get("tokenize") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(fail(format!(
                    "its load answer's `tokenize` is {v}, expected true or false"
                )))
            }
        };
        Ok(engine)
    }

    /// Sends one request and waits for its response (an object with
    /// `"ok": true`; anything else is an error naming the request).
    fn request(&self, op: &str, req: Value) -> Result<Value> {
        let mut p = self.proc.lock().unwrap_or_else(|e| e.into_inner());
        let what = format!("`{}` ({}) on request `{op}`", self.spec.name, self.spec.command_line());
        if let Some(why) = &p.dead {
            return Err(Error::engine(&self.spec.name, format!("{what}: {why}")));
        }
        let line = format!("{req}\n");
        let sent = match p.stdin.as_mut() {
            Some(s) => s.write_all(line.as_bytes()).and_then(|_| s.flush()),
            None => Err(std::io::Error::other("its stdin is closed")),
        };
        if let Err(e) = sent {
            let why = format!("cannot send the request ({e}): {}", exit_note(&mut p));
            return Err(self.kill(&mut p, &what, why));
        }
        match p.lines.recv_timeout(self.spec.timeout) {
            Ok(Ok(text)) => {
                let v: Value = match serde_json::from_str(&text) {
                    Ok(v) => v,
                    Err(e) => {
                        let why = format!("answered with a line that is not JSON ({e}): `{}`", clip(&text, 200));
                        return Err(self.kill(&mut p, &what, why));
                    }
                };
                match v.get("ok").and_then(Value::as_bool) {
                    Some(true) => Ok(v),
                    Some(false) => {
                        let msg = v.get("error").and_then(Value::as_str).unwrap_or("(no `error` given)");
                        Err(Error::engine(
                            &self.spec.name,
                            format!("{what}: the engine reports an error: {msg}{}", log_note(&p)),
                        ))
                    }
                    None => {
                        let why = format!(
                            "answered out of protocol (a response needs \"ok\": true or false): `{}`",
                            clip(&text, 200)
                        );
                        Err(self.kill(&mut p, &what, why))
                    }
                }
            }
            Ok(Err(e)) => Err(self.kill(&mut p, &what, e)),
            Err(RecvTimeoutError::Timeout) => {
                let why = format!(
                    "no answer within {} s (the per-request timeout; a spec sets it with `engines.NAME.timeout_s`); \
                     the process was killed",
                    self.spec.timeout.as_secs_f64()
                );
                Err(self.kill(&mut p, &what, why))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let why = format!("closed its stdout without answering: {}", exit_note(&mut p));
                Err(self.kill(&mut p, &what, why))
            }
        }
    }

    /// Marks the process dead (killing it if it still runs) and returns the
    /// error for this request, with the engine's log.
    fn kill(&self, p: &mut Proc, what: &str, why: String) -> Error {
        let _ = p.child.kill();
        let _ = p.child.wait();
        p.dead = Some(format!(
            "the engine is not usable any more: an earlier request failed: {why}"
        ));
        Error::engine(&self.spec.name, format!("{what}: {why}{}", log_note(p)))
    }
}

/// The process's exit status if it has exited (waiting briefly for it).
fn exit_note(p: &mut Proc) -> String {
    for _ in 0..50 {
        if let Ok(Some(status)) = p.child.try_wait() {
            return format!("the process exited ({status})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    "the process is still running".into()
}

/// The tail of the engine's stderr, for a failure message.
fn log_note(p: &Proc) -> String {
    // Give the stderr thread a moment to drain what the process wrote last.
    std::thread::sleep(Duration::from_millis(50));
    let log = p.log.lock().unwrap_or_else(|e| e.into_inner());
    if log.is_empty() {
        return "\n(the engine wrote nothing to stderr)".into();
    }
    let text = String::from_utf8_lossy(&log);
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(20)..];
    format!(
        "\nthe engine's stderr (last {} lines):\n  {}",
        tail.len(),
        tail.join("\n  ")
    )
}

fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// A VLM run request's `image`: its file (when it has one), and the
/// processed pixels as touchstone feeds its own engines (tensor `pixels`,
/// the `vision.pixels` stage: Qwen-VL's [N, C·T·P·P], LLaVA's [P, 3, S, S],
/// written to `pixels_file`) with the grid and the image's size (H, W) as
/// given (LLaVA-NeXT's unpadding reads it), so an engine may run its own
/// processor or take these pixels.
fn image_json(img: &super::ImageInput, pixels_file: &std::path::Path) -> Result<Value> {
    let floats = [("pixels".to_string(), img.pixels.clone())].into_iter().collect();
    crate::tensor::io::write_safetensors(pixels_file, &floats, &Default::default(), &Default::default())?;
    Ok(json!({
        "path": img.path,
        "pixels": pixels_file,
        "grid_thw": [img.grid.t, img.grid.h, img.grid.w],
        "image_size": img.size.map(|(h, w)| [h, w]),
    }))
}

impl Engine for ExecEngine {
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn arithmetic(&self) -> Option<Arithmetic> {
        self.declared
    }

    fn capabilities(&self) -> super::capabilities::Capabilities {
        self.capabilities.clone()
    }

    /// `{"op":"tokenize","text":…,"chat":…}` → `{"ok":true,"ids":[…]}`, for an
    /// engine whose load answer said `"tokenize": true`.
    fn tokenize(&self, text: &str, chat: bool) -> Option<Result<Vec<u32>>> {
        if !self.tokenizes {
            return None;
        }
        let answer = match self.request("tokenize", json!({"op": "tokenize", "text": text, "chat": chat})) {
            Ok(a) => a,
            Err(e) => return Some(Err(e)),
        };
        let ids = answer.get("ids").and_then(Value::as_array).and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
        });
        Some(ids.ok_or_else(|| {
            Error::engine(
                &self.spec.name,
                format!("its `tokenize` answer has no `ids` list of token ids: {answer}"),
            )
        }))
    }

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn run(&self, req: &RunRequest, taps: &TapSet) -> Result<RunOutput> {
        req.validate(&self.spec.name, self.config.vocab)?;
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = self.work.path().join(format!("run-{n}.safetensors"));
        let taps: Vec<String> = taps.iter().map(|s| s.to_string()).collect();
        let forced = req.forced.as_ref().map(|f| f[..req.decode_steps.min(f.len())].to_vec());
        let image = match &req.image {
            Some(img) => Some(image_json(
                img,
                &self.work.path().join(format!("run-{n}-pixels.safetensors")),
            )?),
            None => None,
        };
        let mut request = json!({
            "op": "run",
            "prompt": req.prompt,
            "decode_steps": req.decode_steps,
            "sampling": super::protocol_json::sampling_json(&req.sampling),
            "seed": req.seed,
            "forced": forced,
            "taps": taps,
            "out": out,
        });
        if let Some(image) = image {
            request["image"] = image;
        }
        self.request("run", request)?;
        self.read_output(&out, req, 0, "run")
    }

    fn run_batch(&self, req: &super::batch::BatchRequest, taps: &TapSet) -> Result<Vec<RunOutput>> {
        let serving = self
            .capabilities
            .serving_or_why()
            .map_err(|why| Error::engine(&self.spec.name, why))?;
        req.validate(&self.spec.name, self.config.vocab, serving)?;
        let n = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let outs: Vec<PathBuf> = (0..req.seqs.len())
            .map(|i| self.work.path().join(format!("batch-{n}-seq-{i}.safetensors")))
            .collect();
        let taps: Vec<String> = taps.iter().map(|s| s.to_string()).collect();
        let request = json!({
            "op": "run_batch",
            "seqs": req.seqs.iter().zip(&outs).map(|(s, o)| super::protocol_json::seq_json(s, o)).collect::<Vec<_>>(),
            "taps": taps,
            "poison": req.poison.map(|p| p.name()),
        });
        let answer = self.request("run_batch", request)?;
        *self.reported.lock().unwrap_or_else(|p| p.into_inner()) = answer.get("memory_bytes").and_then(Value::as_u64);
        req.seqs
            .iter()
            .zip(&outs)
            .map(|(s, o)| self.read_output(o, &s.run, s.prefix.map_or(0, |p| p.len), "run_batch"))
            .collect()
    }

    fn in_process(&self) -> bool {
        false
    }

    /// Its resident set, read from /proc, and the bytes it reported after
    /// its last batch, if it reports them.
    fn memory(&self) -> Result<Vec<super::MemoryReading>> {
        let pid = self.proc.lock().unwrap_or_else(|p| p.into_inner()).child.id();
        let mut out = Vec::new();
        // Only Linux has /proc: elsewhere the resident set is not read.
        if Path::new("/proc/self/status").exists() {
            out.push(super::MemoryReading {
                bytes: super::protocol_json::resident_bytes(pid)?,
                what: format!("the resident set of `{}` (pid {pid}, /proc VmRSS)", self.spec.name),
                exact: false,
            });
        }
        if let Some(b) = *self.reported.lock().unwrap_or_else(|p| p.into_inner()) {
            out.push(super::MemoryReading {
                bytes: b,
                what: format!("the bytes `{}` reports it holds (`memory_bytes`)", self.spec.name),
                exact: true,
            });
        }
        Ok(out)
    }
}

impl ExecEngine {
    /// Reads a run file the engine wrote (then removes it).
    fn read_output(&self, out: &Path, req: &RunRequest, from: usize, op: &str) -> Result<RunOutput> {
        let file = crate::tensor::io::read_safetensors(out).map_err(|e| {
            Error::engine(
                &self.spec.name,
                format!(
                    "`{}` answered `{op}` with ok, but its output is not usable: {e}",
                    self.spec.name
                ),
            )
        })?;
        let _ = std::fs::remove_file(out);
        let read = super::output::read_run_from(&file, &self.names, &self.config, req, from, &self.spec.name)?;
        let mut output = read.output;
        output.unmapped = read.unmapped;
        tag_storage(&mut output, self.storage);
        Ok(output)
    }
}

/// Tags every capture with the run's storage dtype, or the file's own where
/// that is coarser (a bf16 tensor in an f32 run is still bf16-precise).
pub(crate) fn tag_storage(out: &mut RunOutput, storage: crate::tensor::DType) {
    for (_, t) in out.captures.iter_mut() {
        let d = t.dtype().coarser(storage);
        t.set_dtype(d);
    }
}

impl Drop for ExecEngine {
    /// `shutdown`, then a short grace period, then kill: a stuck engine never
    /// outlives touchstone.
    fn drop(&mut self) {
        let p = self.proc.get_mut().unwrap_or_else(|e| e.into_inner());
        if p.dead.is_none() {
            if let Some(s) = p.stdin.as_mut() {
                let _ = s.write_all(b"{\"op\":\"shutdown\"}\n").and_then(|_| s.flush());
            }
            p.stdin = None;
            for _ in 0..100 {
                if let Ok(Some(_)) = p.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_split_like_a_shell() {
        let e = ExecSpec::parse_cli("python3 'my engine.py' --flag x").unwrap();
        assert_eq!(e.argv, ["python3", "my engine.py", "--flag", "x"]);
        assert_eq!(e.command_line(), "python3 'my engine.py' --flag x");
        assert!(ExecSpec::parse_cli("python3 'open").is_err());
        assert!(ExecSpec::parse_cli("   ").is_err());
    }

    #[test]
    fn a_vlm_request_carries_the_image_file_the_pixels_and_the_grid() {
        let d = tempfile::tempdir().unwrap();
        let img = crate::engine::ImageInput {
            pixels: crate::tensor::Tensor::new(vec![4, 3], (0..12).map(|i| i as f32 * 0.5).collect()),
            grid: crate::model::ImageGrid { t: 1, h: 2, w: 2 },
            size: None,
            path: Some("/images/cat.png".into()),
            origin: "test".into(),
        };
        let file = d.path().join("px.safetensors");
        let j = image_json(&img, &file).unwrap();
        assert_eq!(j["path"], "/images/cat.png");
        assert_eq!(j["grid_thw"], json!([1, 2, 2]));
        assert_eq!(j["pixels"], json!(file));
        let back = crate::tensor::io::read_safetensors(&file).unwrap();
        assert_eq!(back.floats["pixels"], img.pixels);
    }

    #[test]
    fn a_load_answer_can_say_the_engine_takes_no_images() {
        use super::super::capabilities::Capabilities;
        let c = Capabilities::from_answer(&json!({"ok": true, "images": false, "why": "text only"})).unwrap();
        assert!(c.no_images.unwrap().contains("text only"));
        assert!(Capabilities::from_answer(&json!({"ok": true, "images": true}))
            .unwrap()
            .no_images
            .is_none());
        // Saying nothing is text-only: taking an image is declared.
        let silent = Capabilities::from_answer(&json!({"ok": true})).unwrap();
        assert!(silent.no_images.unwrap().contains("does not declare"));
        assert!(Capabilities::from_answer(&json!({"images": "no"}))
            .unwrap_err()
            .contains("`images`"));
    }
}
