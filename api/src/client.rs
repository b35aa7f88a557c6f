//! The CLI's client commands: HTTP calls against any node, printed as tables
//! (or the server's JSON with `--json`).

use std::collections::BTreeMap;
use std::io::BufRead;
use std::io::IsTerminal;
use std::io::Write;
use std::time::Duration;

use serde_json::Value;
use serde_json::json;

use crate::cli::Command;
use crate::cli::NodeCommand;
use crate::cli::Target;
use crate::cli::TopicCommand;

/// Bound on one CLI request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `consume --follow` waits between empty polls.
const FOLLOW_POLL: Duration = Duration::from_millis(500);
/// How many 421 redirects one CLI request follows before it reports the last one.
const MAX_REDIRECTS: usize = 3;

struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

struct Answer {
    status: reqwest::StatusCode,
    headers: reqwest::header::HeaderMap,
    body: bytes::Bytes,
}

impl Answer {
    fn json(&self) -> Result<Value, String> {
        serde_json::from_slice(&self.body).map_err(|e| format!("the server answered non-JSON: {e}"))
    }

    /// The answer, or an error carrying the server's error code and message.
    fn ok(self) -> Result<Answer, String> {
        if self.status.is_success() {
            return Ok(self);
        }
        let v: Value = serde_json::from_slice(&self.body).unwrap_or(Value::Null);
        Err(format!(
            "{} {}: {}",
            self.status.as_u16(),
            v["error"]["code"].as_str().unwrap_or("error"),
            v["error"]["message"].as_str().unwrap_or("")
        ))
    }
}

/// `url` without a trailing `/`, with `http://` in front when it names no scheme
/// (`127.0.0.1:8080`).
pub(crate) fn base_url(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if url.contains("://") { url.to_string() } else { format!("http://{url}") }
}

impl Client {
    fn new(target: &Target) -> Result<Client, String> {
        let mut http = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if let Some(path) = &target.ca_file {
            http = http.tls_built_in_root_certs(false);
            for root in crate::tls::client_roots(path).map_err(|e| e.to_string())? {
                http = http.add_root_certificate(root);
            }
        }
        let http = http.build().map_err(|e| e.to_string())?;
        Ok(Client { http, base: base_url(&target.url), token: target.token.clone() })
    }

    /// Sends the request, following a 421's `X-Kv-Redirect` (the node that can serve it, as
    /// a node started with `--forward=false` answers) up to [`MAX_REDIRECTS`] times.
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Vec<u8>>) -> Result<Answer, String> {
        let mut url = format!("{}{path}", self.base);
        let mut hops = 0;
        loop {
            let answer = self.send_to(method.clone(), &url, body.clone()).await?;
            if answer.status != reqwest::StatusCode::MISDIRECTED_REQUEST || hops == MAX_REDIRECTS {
                return Ok(answer);
            }
            let next = answer.headers.get("x-kv-redirect").and_then(|v| v.to_str().ok());
            match next {
                Some(next) if next.starts_with("http://") || next.starts_with("https://") => {
                    url = next.to_string();
                    hops += 1;
                }
                _ => return Ok(answer),
            }
        }
    }

    async fn send_to(&self, method: reqwest::Method, url: &str, body: Option<Vec<u8>>) -> Result<Answer, String> {
        let mut req = self.http.request(method, url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let resp = req.send().await.map_err(|e| format!("cannot reach {}: {}", base_of(url), cause_of(&e)))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.bytes().await.map_err(|e| format!("reading the answer: {}", cause_of(&e)))?;
        Ok(Answer { status, headers, body })
    }

    async fn get(&self, path: &str) -> Result<Answer, String> {
        self.send(reqwest::Method::GET, path, None).await
    }

    async fn json_call(&self, method: reqwest::Method, path: &str, body: &Value) -> Result<Answer, String> {
        self.send(method, path, Some(body.to_string().into_bytes())).await
    }
}

/// `scheme://host:port` of a URL, for error messages.
fn base_of(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    url[after_scheme..].find('/').map_or(url, |i| &url[..after_scheme + i])
}

/// Percent-encodes a key or topic name as one URL path segment (unreserved bytes stay).
pub fn encode_key(key: &[u8]) -> String {
    let mut out = String::with_capacity(key.len());
    for &b in key {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The query naming a key's partition (`--partition`), or nothing.
fn in_partition(partition: Option<u32>) -> String {
    partition.map(|p| format!("partition={p}")).unwrap_or_default()
}

/// The path of a key's lookup, write or delete, with `query` (`name=value&...`, or empty).
/// The keys `.` and `..` travel base64url-encoded: URL clients resolve them as dot segments,
/// percent-encoded or not, and the request would reach another route.
pub fn kv_path(topic: &str, key: &[u8], query: &str) -> String {
    use base64::Engine;
    let topic = encode_key(topic.as_bytes());
    let mut path = if matches!(key, b"." | b"..") {
        let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key);
        format!("/kv/{topic}/{key}?key_encoding=base64url")
    } else {
        format!("/kv/{topic}/{}", encode_key(key))
    };
    if !query.is_empty() {
        path.push(if path.contains('?') { '&' } else { '?' });
        path.push_str(query);
    }
    path
}

/// Writes `text` and a newline to stdout; a reader that went away (`logdex ... | head`) is an
/// error to report, not a panic.
fn say(text: impl std::fmt::Display) -> Result<(), String> {
    writeln!(std::io::stdout().lock(), "{text}").map_err(|e| format!("writing to stdout: {e}"))
}

fn print_json(v: &Value) -> Result<(), String> {
    say(serde_json::to_string_pretty(v).unwrap_or_default())
}

/// Left-aligned columns separated by two spaces.
fn print_table(header: &[&str], rows: &[Vec<String>]) -> Result<(), String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.len());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let text: Vec<String> = cells.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect();
        say(text.join("  ").trim_end())
    };
    line(header.iter().map(|h| h.to_string()).collect())?;
    for row in rows {
        line(row.clone())?;
    }
    Ok(())
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

fn print_topic(v: &Value) -> Result<(), String> {
    say(format_args!(
        "topic {}  replication factor {}  config {}",
        cell(&v["name"]),
        cell(&v["replication_factor"]),
        v["config"]
    ))?;
    let rows: Vec<Vec<String>> = v["partitions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let moving = p.get("move").map_or(String::new(), |m| format!("-> {}", cell(&m["target_replicas"])));
            vec![
                cell(&p["partition"]),
                cell(&p["leader"]),
                cell(&p["replicas"]),
                cell(&p["high_watermark"]),
                cell(&p["log_start_offset"]),
                moving,
            ]
        })
        .collect();
    print_table(&["PARTITION", "LEADER", "REPLICAS", "HIGH WATERMARK", "LOG START", "MOVE"], &rows)
}

pub async fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Topic { command, target } => topic(command, &target).await,
        Command::Put { topic, key, value, partition, target } => {
            let value = if value == "-" {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf).map_err(|e| e.to_string())?;
                buf
            } else {
                value.into_bytes()
            };
            let c = Client::new(&target)?;
            let a = c
                .send(reqwest::Method::PUT, &kv_path(&topic, key.as_bytes(), &in_partition(partition)), Some(value))
                .await?
                .ok()?;
            written(&a, target.json)
        }
        Command::Del { topic, key, partition, target } => {
            let c = Client::new(&target)?;
            let path = kv_path(&topic, key.as_bytes(), &in_partition(partition));
            let a = c.send(reqwest::Method::DELETE, &path, None).await?.ok()?;
            written(&a, target.json)
        }
        Command::Get { topic, key, read, verbose, partition, target } => {
            let c = Client::new(&target)?;
            let query = [format!("read={read}"), in_partition(partition)].join("&");
            let a = c.get(&kv_path(&topic, key.as_bytes(), query.trim_end_matches('&'))).await?;
            if verbose {
                for name in ["x-kv-partition", "x-kv-offset", "x-kv-high-watermark", "x-kv-node", "x-kv-timestamp"] {
                    if let Some(v) = a.headers.get(name).and_then(|v| v.to_str().ok()) {
                        eprintln!("{name}: {v}");
                    }
                }
            }
            let a = a.ok()?;
            let mut out = std::io::stdout();
            out.write_all(&a.body).map_err(|e| e.to_string())?;
            if out.is_terminal() {
                say("")?;
            }
            Ok(())
        }
        Command::Produce { topic, batch, target } => produce(&topic, batch.clamp(1, 10_000), &target).await,
        Command::Consume { topic, partition, offset, max, follow, target } => {
            consume(&topic, partition, offset, max, follow, &target).await
        }
        Command::Move { topic, partition, nodes, target } => {
            let c = Client::new(&target)?;
            let path = format!("/topics/{}/partitions/{partition}/replicas", encode_key(topic.as_bytes()));
            let v = c.json_call(reqwest::Method::PUT, &path, &json!({ "replicas": nodes })).await?.ok()?.json()?;
            if target.json { print_json(&v) } else { print_topic(&v) }
        }
        Command::Cluster { target } => {
            let v = Client::new(&target)?.get("/cluster").await?.ok()?.json()?;
            if target.json {
                return print_json(&v);
            }
            say(format_args!("controller leader: node {}", cell(&v["controller_leader"])))?;
            say(format_args!("controller voters: {}", cell(&v["controller_voters"])))?;
            if v["removed_nodes"].as_array().is_some_and(|r| !r.is_empty()) {
                say(format_args!("removed nodes: {}", cell(&v["removed_nodes"])))?;
            }
            let rows: Vec<Vec<String>> = v["nodes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|n| {
                    let count = |k: &str| n[k].as_array().map_or(0, Vec::len).to_string();
                    vec![
                        cell(&n["node_id"]),
                        cell(&n["http_addr"]),
                        cell(&n["rpc_addr"]),
                        if n["alive"].as_bool() == Some(true) { "up".into() } else { "unreachable".into() },
                        cell(&n["controller_role"]),
                        count("groups_hosted"),
                        count("groups_led"),
                    ]
                })
                .collect();
            print_table(&["NODE", "HTTP", "RPC", "STATE", "CONTROLLER", "HOSTS", "LEADS"], &rows)
        }
        Command::Node { command: NodeCommand::Remove { node_id }, target } => {
            let c = Client::new(&target)?;
            let answer = c.send(reqwest::Method::DELETE, &format!("/cluster/nodes/{node_id}"), None).await?.ok()?;
            let accepted = answer.status == reqwest::StatusCode::ACCEPTED;
            let v = answer.json()?;
            if target.json {
                return print_json(&v);
            }
            say(format_args!("removed node {node_id}; controller voters: {}", cell(&v["controller_voters"])))?;
            if accepted {
                say(format_args!(
                    "the controller's leader has not taken it out of the controller group yet: `logdex cluster` shows when"
                ))?;
            }
            Ok(())
        }
        Command::Serve(_) | Command::Dev(_) | Command::Bench(_) => Err("not a client command".into()),
    }
}

fn written(a: &Answer, json_out: bool) -> Result<(), String> {
    let v = a.json()?;
    if json_out {
        print_json(&v)
    } else {
        say(format_args!("partition {} offset {}", cell(&v["partition"]), cell(&v["offset"])))
    }
}

async fn topic(command: TopicCommand, target: &Target) -> Result<(), String> {
    let c = Client::new(target)?;
    let v = match command {
        TopicCommand::Create { name, partitions, replication_factor, config } => {
            let config: serde_json::Map<String, Value> =
                config.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
            let mut body = json!({ "name": name, "partitions": partitions, "config": config });
            if let Some(replication_factor) = replication_factor {
                body["replication_factor"] = json!(replication_factor);
            }
            c.json_call(reqwest::Method::POST, "/topics", &body).await?.ok()?.json()?
        }
        TopicCommand::List => {
            let v = c.get("/topics").await?.ok()?.json()?;
            if target.json {
                return print_json(&v);
            }
            for name in v["topics"].as_array().into_iter().flatten() {
                say(cell(name))?;
            }
            return Ok(());
        }
        TopicCommand::Describe { name } => {
            c.get(&format!("/topics/{}", encode_key(name.as_bytes()))).await?.ok()?.json()?
        }
        TopicCommand::Delete { name } => {
            let path = format!("/topics/{}", encode_key(name.as_bytes()));
            let v = c.send(reqwest::Method::DELETE, &path, None).await?.ok()?.json()?;
            return if target.json { print_json(&v) } else { say(format_args!("deleted {name}")) };
        }
        TopicCommand::Alter { name, config } => {
            let config: serde_json::Map<String, Value> =
                config.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
            c.json_call(
                reqwest::Method::POST,
                &format!("/topics/{}/config", encode_key(name.as_bytes())),
                &json!({ "config": config }),
            )
            .await?
            .ok()?
            .json()?
        }
    };
    if target.json { print_json(&v) } else { print_topic(&v) }
}

async fn produce(topic: &str, batch: usize, target: &Target) -> Result<(), String> {
    let c = Client::new(target)?;
    let progress = std::io::stderr().is_terminal();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut total = 0u64;
    // Learned at the first batch a node cannot take whole.
    let mut partitions: Option<u32> = None;
    loop {
        let mut records = Vec::with_capacity(batch);
        for line in lines.by_ref().take(batch) {
            let line = line.map_err(|e| format!("reading stdin: {e}"))?;
            let number = total + records.len() as u64 + 1;
            let record = match line.split_once('\t') {
                Some(("", _)) => {
                    return Err(format!(
                        "line {number}: the key before the tab is empty (a line without a tab is a record \
                         without a key); {total} records written before it"
                    ));
                }
                Some((k, v)) => json!({ "key": k, "value": v }),
                None => json!({ "value": line }),
            };
            records.push(record);
        }
        if records.is_empty() {
            break;
        }
        let n = records.len() as u64;
        let path = format!("/topics/{}/records", encode_key(topic.as_bytes()));
        let answer = c.json_call(reqwest::Method::POST, &path, &json!({ "records": records })).await?;
        if answer.status == reqwest::StatusCode::MISDIRECTED_REQUEST {
            // A node started with `--forward=false` takes a batch whole only when it leads
            // every partition the batch names (nothing was written): send each partition's
            // records on its own, each to its leader through the redirect, and the records
            // without a key together, for the node to place in a partition it leads.
            let partitions = match partitions {
                Some(p) => p,
                None => *partitions.insert(partition_count(&c, topic).await?),
            };
            let (keyed, keyless) = split_by_partition(records, partitions);
            let parts = keyed
                .into_iter()
                .map(|(partition, part)| (format!("partition {partition}"), part))
                .chain((!keyless.is_empty()).then(|| ("the records without a key".to_string(), keyless)));
            let mut sent = 0;
            for (what, part) in parts {
                let count = part.len() as u64;
                let body = json!({ "records": part });
                let answer = c.json_call(reqwest::Method::POST, &path, &body).await?;
                let answer =
                    answer.ok().map_err(|e| format!("{what}: {e} ({} records written before these)", total + sent))?;
                print_offsets(&answer, target.json)?;
                sent += count;
            }
        } else {
            // The server names a record by its place in this request: say which lines those are.
            let answer = answer.ok().map_err(|e| {
                format!(
                    "lines {} to {} (record 0 is line {0}): {e}; {total} records written before them",
                    total + 1,
                    total + n
                )
            })?;
            print_offsets(&answer, target.json)?;
        }
        total += n;
        if progress {
            eprint!("\rproduced {total} records");
        }
    }
    if progress {
        eprintln!();
    }
    if target.json {
        eprintln!("produced {total} records to {topic}");
    } else {
        say(format_args!("produced {total} records to {topic}"))?;
    }
    Ok(())
}

/// With `--json`, the server's answer to one produce request (its records' offsets), as one
/// line of JSON.
fn print_offsets(answer: &Answer, json_out: bool) -> Result<(), String> {
    if json_out {
        say(answer.json()?)?;
    }
    Ok(())
}

/// The number of partitions of `topic`.
async fn partition_count(c: &Client, topic: &str) -> Result<u32, String> {
    let v = c.get(&format!("/topics/{}", encode_key(topic.as_bytes()))).await?.ok()?.json()?;
    v["partitions"]
        .as_array()
        .map(|p| p.len() as u32)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("topic {topic} was described without partitions: {v}"))
}

/// `records` (`{"key", "value"}` objects) with a key, grouped by the partition the server
/// would give them (Kafka's murmur2 of the key), each naming it, in partition order and in
/// their own order within a partition; and the records without a key, in their order, naming
/// no partition (a node places them together).
fn split_by_partition(records: Vec<Value>, partitions: u32) -> (BTreeMap<u32, Vec<Value>>, Vec<Value>) {
    let mut keyed: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
    let mut keyless = Vec::new();
    for mut record in records {
        match record["key"].as_str() {
            Some(key) => {
                let partition = crate::murmur2::partition_for_key(key.as_bytes(), partitions);
                record["partition"] = json!(partition);
                keyed.entry(partition).or_default().push(record);
            }
            None => keyless.push(record),
        }
    }
    (keyed, keyless)
}

/// A key or value of a base64 fetch page as one field of a `consume` line: UTF-8 text with
/// `\\`, `\t`, `\n` and `\r` escaped, `\xNN` for each byte that is not UTF-8 text or is
/// another control character, and `\N` for none (a record without a key, a tombstone).
fn escaped_field(field: &Value) -> Result<String, String> {
    use base64::Engine;
    let Some(text) = field.as_str() else { return Ok("\\N".to_string()) };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("the server sent a field that is not base64 ({e})"))?;
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\t' => out.push_str("\\t"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                c if c.is_control() => {
                    let mut buf = [0; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.push_str(&format!("\\x{b:02x}"));
                    }
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    Ok(out)
}

async fn consume(
    topic: &str,
    partition: u32,
    mut offset: u64,
    max: Option<u64>,
    follow: bool,
    target: &Target,
) -> Result<(), String> {
    let c = Client::new(target)?;
    let mut printed = 0u64;
    let mut out = std::io::stdout().lock();
    loop {
        let want = max.map_or(500, |m| m.saturating_sub(printed).min(500));
        if want == 0 {
            return Ok(());
        }
        // Text lines take the bytes (base64 on the wire) and escape them; JSON lines keep the
        // page's own spelling and say which it is.
        let encoding = if target.json { "auto" } else { "base64" };
        let path = format!(
            "/topics/{}/partitions/{partition}/records?offset={offset}&max_records={want}&encoding={encoding}",
            encode_key(topic.as_bytes())
        );
        let v = c.get(&path).await?.ok()?.json()?;
        let records = v["records"].as_array().cloned().unwrap_or_default();
        for r in &records {
            if target.json {
                let mut r = r.clone();
                r["encoding"] = v["encoding"].clone();
                writeln!(out, "{r}").map_err(|e| e.to_string())?;
            } else {
                let (key, value) = (escaped_field(&r["key"])?, escaped_field(&r["value"])?);
                writeln!(out, "{}\t{key}\t{value}", cell(&r["offset"])).map_err(|e| e.to_string())?;
            }
            printed += 1;
        }
        out.flush().map_err(|e| e.to_string())?;
        offset = v["next_offset"].as_u64().unwrap_or(offset);
        if records.is_empty() {
            if !follow {
                return Ok(());
            }
            tokio::select! {
                _ = tokio::time::sleep(FOLLOW_POLL) => {}
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
        }
    }
}

/// What went wrong at the bottom of an error's chain ("Connection refused (os error 111)"),
/// after the top ("error sending request for url (...)"): the top alone names no cause.
fn cause_of(e: &(dyn std::error::Error + 'static)) -> String {
    let mut root = None;
    let mut next = e.source();
    while let Some(cause) = next {
        root = Some(cause);
        next = cause.source();
    }
    match root {
        Some(root) => format!("{e}: {root}"),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_scheme_is_taken_as_http() {
        assert_eq!(base_url("127.0.0.1:8080"), "http://127.0.0.1:8080");
        assert_eq!(base_url("localhost:8080/"), "http://localhost:8080");
        assert_eq!(base_url("https://node-1:8443/"), "https://node-1:8443");
        assert_eq!(base_url("http://127.0.0.1:8081"), "http://127.0.0.1:8081");
    }

    #[test]
    fn a_split_batch_keeps_each_keys_partition_and_the_order_and_the_keyless_records_together() {
        let records: Vec<Value> = (0..40)
            .map(|i| {
                if i % 4 == 3 {
                    json!({ "value": format!("v{i}") })
                } else {
                    json!({ "key": format!("k{i}"), "value": format!("v{i}") })
                }
            })
            .collect();
        let (keyed, keyless) = split_by_partition(records.clone(), 6);
        assert_eq!(keyed.values().map(Vec::len).sum::<usize>() + keyless.len(), records.len());
        // In the order of the input within each group.
        let numbers = |part: &[Value]| -> Vec<u32> {
            part.iter().filter_map(|r| r["value"].as_str()?.strip_prefix('v')?.parse().ok()).collect()
        };
        for (partition, part) in &keyed {
            for r in part {
                assert_eq!(r["partition"], json!(partition));
                let key = r["key"].as_str().unwrap_or_default();
                assert_eq!(crate::murmur2::partition_for_key(key.as_bytes(), 6), *partition);
            }
            let numbers = numbers(part);
            assert!(numbers.windows(2).all(|w| w[0] < w[1]), "partition {partition}: {numbers:?}");
        }
        assert_eq!(numbers(&keyless), (0..10).map(|i| i * 4 + 3).collect::<Vec<u32>>());
        assert!(keyless.iter().all(|r| r.get("partition").is_none()), "the node places records without a key");
    }

    #[test]
    fn consume_fields_are_escaped_so_tabs_newlines_and_bytes_cannot_break_a_line() -> Result<(), String> {
        use base64::Engine;
        let field = |bytes: &[u8]| Value::String(base64::engine::general_purpose::STANDARD.encode(bytes));
        assert_eq!(escaped_field(&field(b"plain text"))?, "plain text");
        assert_eq!(escaped_field(&field(b"multi\nline\tv\\"))?, "multi\\nline\\tv\\\\");
        assert_eq!(escaped_field(&field(b"\xff\x00\x01ok"))?, "\\xff\\x00\\x01ok");
        assert_eq!(escaped_field(&field("héllo".as_bytes()))?, "héllo");
        assert_eq!(escaped_field(&field(b""))?, "");
        assert_eq!(escaped_field(&Value::Null)?, "\\N", "a record without a key, a tombstone");
        assert!(escaped_field(&Value::String("not base64!".into())).is_err());
        Ok(())
    }

    #[test]
    fn dot_keys_go_base64url_and_queries_join_with_the_right_separator() {
        assert_eq!(kv_path("t", b"k", ""), "/kv/t/k");
        assert_eq!(kv_path("t", b"k", "read=follower"), "/kv/t/k?read=follower");
        assert_eq!(kv_path("t", b".", ""), "/kv/t/Lg?key_encoding=base64url");
        assert_eq!(kv_path("t", b"..", "read=strict"), "/kv/t/Li4?key_encoding=base64url&read=strict");
        assert_eq!(kv_path("a b", b"x/y", ""), "/kv/a%20b/x%2Fy");
    }

    #[test]
    fn error_messages_name_the_node_a_url_points_at() {
        assert_eq!(base_of("http://127.0.0.1:8082/kv/t/k?read=follower"), "http://127.0.0.1:8082");
        assert_eq!(base_of("https://node-2:8443/"), "https://node-2:8443");
        assert_eq!(base_of("http://127.0.0.1:8081"), "http://127.0.0.1:8081");
    }

    #[test]
    fn cause_of_adds_the_bottom_of_the_chain_to_the_top() {
        #[derive(Debug)]
        struct Sending(std::io::Error);
        impl std::fmt::Display for Sending {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("error sending request")
            }
        }
        impl std::error::Error for Sending {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = Sending(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused"));
        assert_eq!(cause_of(&refused), "error sending request: Connection refused");
        assert_eq!(cause_of(&std::io::Error::other("alone")), "alone");
    }
}
