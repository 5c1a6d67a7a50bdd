//! What `goldens regen` shows while the recorders run (minutes on a real
//! model): an indicatif bar when stderr is a terminal, plain lines otherwise;
//! and how a recorder's output is streamed to it as it comes.

use std::io::{BufRead, BufReader, IsTerminal};
use std::process::{Command, Stdio};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::error::{Error, Result};

/// Progress: an indicatif bar when stderr is a terminal, plain lines otherwise.
pub struct Progress {
    bar: Option<ProgressBar>,
    step: u64,
    total: u64,
}

impl Progress {
    pub fn new(total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("{spinner} regen [{pos}/{len}] {wide_msg} {elapsed}")
                    .expect("valid template"),
            );
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        Progress { bar, step: 0, total }
    }
    /// Starts the next long step.
    pub fn start(&mut self, msg: &str) {
        self.step += 1;
        match &self.bar {
            Some(b) => {
                b.set_position(self.step - 1);
                b.set_message(msg.to_string());
            }
            None => eprintln!("regen: [{}/{}] {msg}", self.step, self.total),
        }
    }
    /// Detail inside a step (e.g. pip's progress): the bar's message, or a plain line.
    pub fn detail(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.set_message(msg.to_string()),
            None => eprintln!("regen:       {msg}"),
        }
    }
    /// A line that stays (printed above the bar).
    pub fn println(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("regen: {msg}"),
        }
    }
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Runs `cmd`, streaming its output lines (stdout and stderr, as they come)
/// to `on_line`; returns the collected output and whether it succeeded.
pub fn run_streaming(mut cmd: Command, mut on_line: impl FnMut(&str)) -> Result<(bool, String)> {
    let prog = format!("{:?}", cmd.get_program());
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Usage(format!("cannot run {prog}: {e}")))?;
    // One reader thread per pipe so neither can fill up and block the child;
    // the lines come back here because `on_line` (the progress bar) stays on
    // this thread.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let readers: Vec<_> = [
        Box::new(child.stdout.take().expect("piped")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("piped")),
    ]
    .into_iter()
    .map(|pipe| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        })
    })
    .collect();
    drop(tx);
    let mut all = String::new();
    for line in rx {
        on_line(&line);
        all += &line;
        all.push('\n');
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(|e| Error::Usage(format!("{prog}: {e}")))?;
    Ok((status.success(), all))
}

pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
