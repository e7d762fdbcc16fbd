//! Captures `tracing` events as text lines, for tests that check what is logged.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Every event and span field recorded, one line each: `LEVEL message field=value …`.
#[derive(Clone, Default)]
pub struct Logs {
    lines: Arc<Mutex<Vec<String>>>,
    next_span: Arc<AtomicU64>,
    /// The spans entered, innermost last (the test runs on one thread).
    entered: Arc<Mutex<Vec<u64>>>,
    /// What each span is, for `Span::current()`.
    metadata: Arc<Mutex<std::collections::HashMap<u64, &'static Metadata<'static>>>>,
}

impl Logs {
    /// The lines captured so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// The captured lines that contain `text`.
    pub fn matching(&self, text: &str) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.contains(text))
            .collect()
    }

    /// Captures what the current thread logs until the guard is dropped (run the test on a
    /// `current_thread` runtime so that its futures log on this thread).
    pub fn capture_here() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Self::default();
        let guard = tracing::subscriber::set_default(logs.clone());
        (logs, guard)
    }

    /// Captures what every thread logs, from the first call on, for the rest of the test
    /// binary (a manager's background tasks run on a thread of their own). Other tests log
    /// here too: look for lines that name what the test made.
    pub fn global() -> &'static Self {
        static GLOBAL: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        GLOBAL.get_or_init(|| {
            let logs = Self::default();
            tracing::subscriber::set_global_default(logs.clone()).expect("one global subscriber");
            logs
        })
    }

    fn push(&self, line: String) {
        self.lines.lock().unwrap().push(line);
    }
}

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl Subscriber for Logs {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    /// `SPAN name id=N parent=P level=L field=value …` (`parent=0`: a root span).
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next_span.fetch_add(1, Ordering::Relaxed) + 1;
        let parent = match span.parent() {
            Some(parent) => parent.into_u64(),
            None if span.is_contextual() => {
                self.entered.lock().unwrap().last().copied().unwrap_or(0)
            }
            None => 0,
        };
        self.metadata.lock().unwrap().insert(id, span.metadata());
        let level = span.metadata().level();
        let name = span.metadata().name();
        let mut line = Line(format!("SPAN {name} id={id} parent={parent} level={level}"));
        span.record(&mut line);
        self.push(line.0);
        Id::from_u64(id)
    }

    /// `SPAN-RECORD id=N field=value …`.
    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut line = Line(format!("SPAN-RECORD id={}", id.into_u64()));
        values.record(&mut line);
        self.push(line.0);
    }

    /// `SPAN-CLOSE id=N`.
    fn try_close(&self, id: Id) -> bool {
        self.push(format!("SPAN-CLOSE id={}", id.into_u64()));
        true
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut line = Line(event.metadata().level().to_string());
        event.record(&mut line);
        self.push(line.0);
    }

    fn current_span(&self) -> tracing_core::span::Current {
        let entered = self.entered.lock().unwrap();
        let metadata = self.metadata.lock().unwrap();
        match entered
            .last()
            .and_then(|id| Some((*id, *metadata.get(id)?)))
        {
            Some((id, meta)) => tracing_core::span::Current::new(Id::from_u64(id), meta),
            None => tracing_core::span::Current::none(),
        }
    }

    fn enter(&self, id: &Id) {
        self.entered.lock().unwrap().push(id.into_u64());
    }

    fn exit(&self, id: &Id) {
        let mut entered = self.entered.lock().unwrap();
        if let Some(at) = entered.iter().rposition(|&one| one == id.into_u64()) {
            entered.remove(at);
        }
    }
}
