//! `EngineHandle`: `EngineCore` on its own OS thread.
//!
//! Submits and aborts travel over a command channel; deltas come back through one output queue
//! that `poll` drains (waiting on a condvar, so a caller can release the GIL and block). The
//! thread steps while there is work and sleeps on the channel when idle: no busy spin. Requests
//! are validated on the caller's thread, once, so bad input is rejected at once.

use std::collections::HashSet;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{EngineCore, EngineStats, FinishReason, RequestOutput, RequestValidator};
use crate::sampling::{GrammarConstraint, SamplingParams};
use crate::{NinferError, Result};

#[allow(clippy::large_enum_variant)] // a few commands a request; boxing would only add an allocation
enum Command {
    Submit { request_id: String, prompt: Vec<u32>, params: SamplingParams, grammar: Option<GrammarConstraint> },
    Abort(String),
    Score { tokens: Vec<u32>, reply: Sender<Result<Vec<f32>>> },
    Shutdown,
}

#[derive(Default)]
struct Outbox {
    outputs: Vec<RequestOutput>,
    error: Option<String>,
    stats: EngineStats,
    stopped: bool,
}

struct Shared {
    outbox: Mutex<Outbox>,
    ready: Condvar,
    /// Request ids in use (duplicate check on the caller's thread).
    ids: Mutex<LiveIds>,
}

/// An id stays in use until the caller has drained its final delta, so that two requests of one
/// id never have deltas in the queue at once (whatever the engine thread's pace).
#[derive(Default)]
struct LiveIds {
    /// Submitted, final delta not yet queued.
    running: HashSet<String>,
    /// Final delta queued, not yet drained by `poll` / `wait`.
    queued: HashSet<String>,
}

impl LiveIds {
    /// `id`'s final delta is queued.
    fn finish(&mut self, id: &str) {
        self.running.remove(id);
        self.queued.insert(id.to_string());
    }
}

/// Handle to the engine thread. Every method takes `&self` and is safe to call from several
/// threads at once: `poll` waits without blocking `submit` / `abort`.
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
    validator: RequestValidator,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineHandle {
    /// Move `core` onto a new thread and start its loop.
    pub fn start(core: EngineCore) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared { outbox: Mutex::new(Outbox::default()), ready: Condvar::new(), ids: Mutex::new(LiveIds::default()) });
        let validator = core.validator();
        shared.ids.lock().expect("live ids").running.extend(core.request_ids());
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ninfer-engine".into())
            .spawn(move || run_loop(core, rx, thread_shared))
            .map_err(|e| NinferError::Device(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle { tx, shared, validator, thread: Mutex::new(Some(thread)) })
    }

    /// Queue a request; bad input and duplicate ids are rejected here, at once.
    pub fn submit(&self, request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        let grammar = self.validator.validate(&prompt, &params)?;
        {
            let mut ids = self.shared.ids.lock().expect("live ids");
            if ids.queued.contains(request_id) {
                return Err(NinferError::Request(request_id.to_string(), "a request with this id has finished but its final output has not been polled yet; poll it before reusing the id".into()));
            }
            if !ids.running.insert(request_id.to_string()) {
                return Err(NinferError::Request(request_id.to_string(), "a request with this id is already running".into()));
            }
        }
        self.send(Command::Submit { request_id: request_id.to_string(), prompt, params, grammar })
    }

    /// Abort a request (its final delta arrives through `poll`).
    pub fn abort(&self, request_id: &str) -> Result<()> {
        self.send(Command::Abort(request_id.to_string()))
    }

    /// All-position logits of `tokens`, computed on the engine thread between steps.
    pub fn score(&self, tokens: Vec<u32>) -> Result<Vec<f32>> {
        let (reply, rx) = mpsc::channel();
        self.send(Command::Score { tokens, reply })?;
        rx.recv().map_err(|_| NinferError::Device("the engine thread has stopped".into()))?
    }

    /// Wait up to `timeout` for deltas; returns at once when some are ready. An engine failure
    /// is returned as an error once its deltas are drained.
    pub fn poll(&self, timeout: Duration) -> Result<Vec<RequestOutput>> {
        self.wait(Some(timeout))
    }

    /// `poll` that, with no timeout, waits until there are deltas, an engine failure, or the
    /// thread has stopped (shutdown): an output pump sleeps here instead of waking on a timer.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<RequestOutput>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut ob = self.shared.outbox.lock().expect("outbox");
        while ob.outputs.is_empty() && ob.error.is_none() && !ob.stopped {
            ob = match deadline {
                None => self.shared.ready.wait(ob).expect("outbox"),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    self.shared.ready.wait_timeout(ob, deadline - now).expect("outbox").0
                }
            };
        }
        if !ob.outputs.is_empty() {
            let outs = std::mem::take(&mut ob.outputs);
            let mut ids = self.shared.ids.lock().expect("live ids");
            for o in outs.iter().filter(|o| o.finished()) {
                ids.queued.remove(&o.request_id);
            }
            return Ok(outs);
        }
        match ob.error.take() {
            Some(e) => Err(NinferError::Device(e)),
            None => Ok(Vec::new()),
        }
    }

    /// Whether any submitted request has not delivered its final delta to the queue.
    pub fn has_unfinished(&self) -> bool {
        !self.shared.ids.lock().expect("live ids").running.is_empty()
    }

    /// Counters as of the last step.
    pub fn stats(&self) -> EngineStats {
        self.shared.outbox.lock().expect("outbox").stats.clone()
    }

    /// Stop the thread (running requests are dropped) and wait for it.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).map_err(|_| NinferError::Device("the engine thread has stopped".into()))
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The engine thread: apply commands, step while there is work, sleep on the channel otherwise.
fn run_loop(mut core: EngineCore, rx: Receiver<Command>, shared: Arc<Shared>) {
    loop {
        let first = if core.has_unfinished() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => break,
            }
        };
        let mut shutdown = false;
        let mut cmd = first;
        while let Some(c) = cmd {
            match c {
                Command::Submit { request_id, prompt, params, grammar } => core.add_checked_request(&request_id, prompt, params, grammar),
                Command::Abort(id) => {
                    core.abort(&id);
                }
                Command::Score { tokens, reply } => {
                    let _ = reply.send(core.score(&tokens));
                }
                Command::Shutdown => shutdown = true,
            }
            cmd = rx.try_recv().ok();
        }
        if shutdown {
            break;
        }
        let result = if core.has_unfinished() { core.step() } else { Ok(Vec::new()) };
        let mut ob = shared.outbox.lock().expect("outbox");
        match result {
            Ok(outs) => {
                let mut ids = shared.ids.lock().expect("live ids");
                for o in outs.iter().filter(|o| o.finished()) {
                    ids.finish(&o.request_id);
                }
                ob.outputs.extend(outs);
            }
            Err(e) => {
                let mut ids = shared.ids.lock().expect("live ids");
                let running: Vec<String> = ids.running.iter().cloned().collect();
                for id in &running {
                    ids.finish(id);
                }
                drop(ids);
                ob.outputs.extend(running.iter().map(|id| aborted(id)));
                ob.error = Some(e.to_string());
                ob.stats = core.stats();
                drop(ob);
                shared.ready.notify_all();
                continue;
            }
        }
        ob.stats = core.stats();
        drop(ob);
        shared.ready.notify_all();
    }
    let mut ob = shared.outbox.lock().expect("outbox");
    ob.stopped = true;
    drop(ob);
    shared.ready.notify_all();
}

/// The final delta of a request cut off by an engine failure (which `poll` then reports).
fn aborted(id: &str) -> RequestOutput {
    RequestOutput {
        request_id: id.to_string(),
        token_ids: Vec::new(),
        text: String::new(),
        logprobs: None,
        finish_reason: Some(FinishReason::Abort),
        prompt_tokens: 0,
        completion_tokens: 0,
        reasoning_tokens: 0,
        cached_tokens: 0,
        error: None,
        stop_reason: None,
        spec: None,
    }
}
