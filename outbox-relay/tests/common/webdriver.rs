//! A small WebDriver client (the W3C protocol, JSON over HTTP) for the console's
//! browser tests: headless Chromium through the chromedriver that
//! scripts/chromium.sh starts and exports as `OUTBOX_WEBDRIVER_URL`.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::request;

/// The key of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A browser session, ended when dropped.
pub struct Browser {
    port: u16,
    session: String,
}

impl Browser {
    /// A new headless Chromium session; fails the test, saying how to get one,
    /// when no chromedriver answers.
    pub fn start() -> Self {
        let url = std::env::var("OUTBOX_WEBDRIVER_URL").unwrap_or_else(|_| {
            panic!(
                "OUTBOX_WEBDRIVER_URL is not set: run the tests through scripts/test.sh, or \
                 `scripts/chromium.sh cargo test ...`, which start chromedriver and headless Chromium"
            )
        });
        let port: u16 = url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .unwrap_or_else(|| {
                panic!("OUTBOX_WEBDRIVER_URL={url}: expected http://127.0.0.1:PORT")
            });
        let mut options = json!({
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1200", "--force-device-scale-factor=1",
            ],
        });
        if let Ok(binary) = std::env::var("OUTBOX_CHROMIUM") {
            options["binary"] = json!(binary);
        }
        let capabilities = json!({
            "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": options,
                "unhandledPromptBehavior": "ignore",
            }}
        });
        let (status, body) = request(
            port,
            "POST",
            "/session",
            &[],
            Some(&capabilities.to_string()),
        )
        .unwrap_or_else(|| {
            panic!("no chromedriver answers at {url} (scripts/chromium.sh starts one)")
        });
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status, 200, "new WebDriver session: {body}");
        let session = answer["value"]["sessionId"].as_str().unwrap().to_string();
        Self { port, session }
    }

    /// One command; the answer's `value`, or the WebDriver error (its `error` code
    /// and message).
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let path = format!("/session/{}{path}", self.session);
        let body = body.map(|b| b.to_string());
        let (status, text) = request(self.port, method, &path, &[], body.as_deref())
            .ok_or_else(|| format!("chromedriver did not answer {method} {path}"))?;
        let answer: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        if status == 200 {
            Ok(answer["value"].clone())
        } else {
            Err(format!(
                "{}: {}",
                answer["value"]["error"].as_str().unwrap_or("?"),
                answer["value"]["message"].as_str().unwrap_or(&text)
            ))
        }
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(method, path, body)
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
    }

    pub fn goto(&self, url: &str) {
        self.ok("POST", "/url", Some(json!({ "url": url })));
    }

    /// The first element matching the CSS `selector`, if any.
    pub fn find(&self, selector: &str) -> Option<String> {
        let found = self.call(
            "POST",
            "/element",
            Some(json!({ "using": "css selector", "value": selector })),
        );
        match found {
            Ok(element) => Some(
                element[ELEMENT]
                    .as_str()
                    .unwrap_or_else(|| panic!("finding {selector}: {element}"))
                    .to_string(),
            ),
            Err(e) if e.starts_with("no such element") => None,
            Err(e) => panic!("finding {selector}: {e}"),
        }
    }

    /// The element matching `selector`, which must be there to `act` on it.
    fn element(&self, selector: &str, act: &str) -> String {
        self.find(selector)
            .unwrap_or_else(|| panic!("no {selector} to {act}"))
    }

    pub fn click(&self, selector: &str) {
        let element = self.element(selector, "click");
        self.ok(
            "POST",
            &format!("/element/{element}/click"),
            Some(json!({})),
        );
    }

    /// Type `text` into the field matching `selector`.
    pub fn type_into(&self, selector: &str, text: &str) {
        let element = self.element(selector, "type into");
        self.ok(
            "POST",
            &format!("/element/{element}/value"),
            Some(json!({ "text": text })),
        );
    }

    /// Run `script` (a function body; `arguments` are `args`) in the page; what it returns.
    pub fn execute(&self, script: &str, args: Value) -> Value {
        self.ok(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
    }

    /// The text content of the first element matching `selector` (`None`: there is none).
    pub fn text(&self, selector: &str) -> Option<String> {
        let value = self.execute(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;",
            json!([selector]),
        );
        value.as_str().map(String::from)
    }

    /// How many elements match `selector`.
    pub fn count(&self, selector: &str) -> usize {
        let value = self.execute(
            "return document.querySelectorAll(arguments[0]).length;",
            json!([selector]),
        );
        usize::try_from(value.as_u64().unwrap()).unwrap()
    }

    /// Look with `probe` every 100 ms until it gives a value; fails the test after
    /// `limit`, with what the last look saw (`seen`) and the page's status line.
    fn wait_for<T, S: std::fmt::Debug>(
        &self,
        what: &str,
        limit: Duration,
        mut probe: impl FnMut() -> Result<T, S>,
    ) -> T {
        let deadline = Instant::now() + limit;
        loop {
            let seen = match probe() {
                Ok(value) => return value,
                Err(seen) => seen,
            };
            assert!(
                Instant::now() < deadline,
                "{what}: not within {limit:?}; last seen {seen:?}; status line: {:?}",
                self.text("#status")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait (at most `limit`) until the text of `selector` satisfies `wanted`; the text.
    pub fn wait_text(
        &self,
        selector: &str,
        limit: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> String {
        self.wait_for(selector, limit, || match self.text(selector) {
            Some(text) if wanted(&text) => Ok(text),
            other => Err(other),
        })
    }

    /// Wait (at most `limit`) until `selector` matches at least `n` elements.
    pub fn wait_count(&self, selector: &str, n: usize, limit: Duration) -> usize {
        let what = format!("{n} of {selector}");
        self.wait_for(&what, limit, || match self.count(selector) {
            count if count >= n => Ok(count),
            count => Err(count),
        })
    }

    /// The text of the open alert, confirm or prompt dialog, if one is open.
    pub fn dialog(&self) -> Option<String> {
        match self.call("GET", "/alert/text", None) {
            Ok(text) => Some(text.as_str().unwrap_or_default().to_string()),
            Err(e) if e.starts_with("no such alert") => None,
            Err(e) => panic!("asking for a dialog: {e}"),
        }
    }

    /// Save a PNG screenshot of the window to `path`.
    pub fn screenshot(&self, path: &Path) {
        let encoded = self.ok("GET", "/screenshot", None);
        let png = base64_decode(encoded.as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "a screenshot is a PNG");
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let path = format!("/session/{}", self.session);
        let _ = request(self.port, "DELETE", &path, &[], None);
    }
}

/// Standard base64 (what WebDriver screenshots are sent as).
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        other => panic!("not base64: {other}"),
    };
    let digits: Vec<u8> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .map(value)
        .collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let bits = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, d)| acc | (u32::from(*d) << (18 - 6 * i)));
        let bytes = bits.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}
