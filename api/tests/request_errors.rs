//! Bad or oversized requests get a clear JSON error with the status and code DESIGN's
//! contract names (413 `too_large`, 400 `invalid_*`), and nothing is written.

mod common;

use common::TestResult;
use common::start_node;
use serde_json::Value;
use serde_json::json;

async fn error_of(response: reqwest::Response) -> TestResult<(u16, String, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    let code = body["error"]["code"].as_str().ok_or("no error code")?.to_string();
    let message = body["error"]["message"].as_str().ok_or("no error message")?.to_string();
    Ok((status, code, message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_over_max_message_bytes_answer_413_until_the_limit_is_raised() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    let created = http
        .post(format!("{url}/topics"))
        .json(
            &json!({"name": "tiny", "partitions": 1, "replication_factor": 1, "config": {"max.message.bytes": "200"}}),
        )
        .send()
        .await?;
    assert_eq!(created.status(), 201);

    let small = http.put(format!("{url}/kv/tiny/small")).body(vec![b's'; 20]).send().await?;
    assert_eq!(small.status(), 200, "a batch under the limit is written");
    let (status, code, message) =
        error_of(http.put(format!("{url}/kv/tiny/big")).body(vec![b'b'; 500]).send().await?).await?;
    assert_eq!((status, code.as_str()), (413, "too_large"), "{message}");
    assert!(message.contains("max.message.bytes"), "the refusal names the limit: {message}");
    let records = json!({"records": [{"key": "r1", "value": "x".repeat(300)}]});
    let (status, code, _) =
        error_of(http.post(format!("{url}/topics/tiny/records")).json(&records).send().await?).await?;
    assert_eq!((status, code.as_str()), (413, "too_large"));
    for key in ["big", "r1"] {
        let got = http.get(format!("{url}/kv/tiny/{key}")).send().await?;
        assert_eq!(got.status(), 404, "refused write of {key} left nothing behind");
    }

    let altered = http
        .post(format!("{url}/topics/tiny/config"))
        .json(&json!({"config": {"max.message.bytes": "10000"}}))
        .send()
        .await?;
    assert_eq!(altered.status(), 200);
    let big = http.put(format!("{url}/kv/tiny/big")).body(vec![b'b'; 500]).send().await?;
    assert_eq!(big.status(), 200, "the raised limit admits the write");
    let got = http.get(format!("{url}/kv/tiny/big")).send().await?;
    assert_eq!(got.bytes().await?.len(), 500);

    // A key over the node's limit is refused in the same words by every request that names it.
    let long = "k".repeat(17_000);
    let said = "key of 17000 bytes exceeds the limit of 16384 bytes";
    let produce = json!({"records": [{"key": long, "value": "v"}]});
    for (what, request) in [
        ("PUT", http.put(format!("{url}/kv/tiny/{long}")).body("v")),
        ("GET", http.get(format!("{url}/kv/tiny/{long}"))),
        ("produce", http.post(format!("{url}/topics/tiny/records")).json(&produce)),
    ] {
        let (status, code, message) = error_of(request.send().await?).await?;
        assert_eq!((status, code.as_str()), (413, "too_large"), "{what}: {message}");
        assert!(message.contains(said), "{what}: {message}");
    }
    node.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parameters_answer_400_with_a_code_that_names_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "t", 2).await?;
    assert_eq!(http.put(format!("{url}/kv/t/k")).body("v").send().await?.status(), 200);

    let (status, code, message) = error_of(http.get(format!("{url}/kv/t/k?partition=2")).send().await?).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_partition"));
    assert!(message.contains("no partition 2") && message.contains("0 to 1"), "{message}");

    for query in ["max_records=0", "max_bytes=0"] {
        let fetch = http.get(format!("{url}/topics/t/partitions/0/records?offset=0&{query}")).send().await?;
        let (status, code, _) = error_of(fetch).await?;
        assert_eq!((status, code.as_str()), (400, "invalid_limit"), "{query}");
    }
    for (path, parameter) in [
        ("topics/t/partitions/0/records?offset=-1", "offset"),
        ("topics/t/partitions/0/records?max_records=many", "max_records"),
        ("kv/t/k?read=follower&min_offset=abc", "min_offset"),
        ("kv/t/k?forward=bogus", "forward"),
    ] {
        let (status, code, message) = error_of(http.get(format!("{url}/{path}")).send().await?).await?;
        assert_eq!((status, code.as_str()), (400, "invalid_query"), "{path}: {message}");
        assert!(message.starts_with(&format!("bad query parameter {parameter}: ")), "{path}: {message}");
        // A page limit starts at 1, as `invalid_limit` says of a zero.
        let low = if parameter.starts_with("max_") { 1 } else { 0 };
        if parameter != "forward" {
            assert!(message.contains(&format!("whole number from {low} to")), "{path}: {message}");
        }
    }

    for method in [reqwest::Method::GET, reqwest::Method::PUT, reqwest::Method::DELETE] {
        let (status, code, _) = error_of(http.request(method.clone(), format!("{url}/kv/t/")).send().await?).await?;
        assert_eq!((status, code.as_str()), (400, "invalid_key"), "{method} of an empty key");
    }

    let alter = http.post(format!("{url}/topics/t/config")).json(&json!({"config": {"segment.bytes": "lots"}}));
    let (status, code, _) = error_of(alter.send().await?).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_config"), "alter answers as create does");
    let create = http
        .post(format!("{url}/topics"))
        .json(&json!({"name": "u", "partitions": 1, "replication_factor": 1, "config": {"segment.bytes": "lots"}}));
    let (status, code, _) = error_of(create.send().await?).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_config"));

    // Each header alone is under the 1 MiB value bound; together they are over it.
    let half = "y".repeat(600 * 1024);
    let headers = json!({"records": [{"key": "h", "value": "v", "headers": {"a": half, "b": half}}]});
    let (status, code, message) =
        error_of(http.post(format!("{url}/topics/t/records")).json(&headers).send().await?).await?;
    assert_eq!((status, code.as_str()), (413, "too_large"), "headers over a value's bound");
    assert!(message.contains("headers exceed"), "{message}");
    assert_eq!(http.get(format!("{url}/kv/t/h")).send().await?.status(), 404, "nothing of it was written");
    let one = json!({"records": [{"key": "h", "value": "v", "headers": {"a": half}}]});
    assert_eq!(http.post(format!("{url}/topics/t/records")).json(&one).send().await?.status(), 200, "one of them fits");

    let empty_key = json!({"records": [{"key": "fine", "value": "v"}, {"key": "", "value": "v"}]});
    let (status, code, message) =
        error_of(http.post(format!("{url}/topics/t/records")).json(&empty_key).send().await?).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_key"), "a produced record with an empty key");
    assert!(message.contains("record 1"), "{message}");
    assert_eq!(http.get(format!("{url}/kv/t/fine")).send().await?.status(), 404, "nothing of that batch was written");

    // A header named twice would keep one value and drop the other unseen; null headers are none.
    let twice = r#"{"records": [{"key": "twice", "value": "v", "headers": {"h": "1", "h": "2"}}]}"#;
    let (status, code, message) = error_of(
        http.post(format!("{url}/topics/t/records"))
            .header("content-type", "application/json")
            .body(twice)
            .send()
            .await?,
    )
    .await?;
    assert_eq!((status, code.as_str()), (400, "invalid_json"), "a header named twice: {message}");
    assert!(message.contains("header `h` is named twice"), "{message}");
    assert_eq!(http.get(format!("{url}/kv/t/twice")).send().await?.status(), 404, "nothing of it was written");
    let no_headers = json!({"records": [{"key": "null-headers", "value": "v", "headers": null}]});
    let written = http.post(format!("{url}/topics/t/records")).json(&no_headers).send().await?;
    assert_eq!(written.status(), 200, "headers: null is a record without headers");
    assert_eq!(http.get(format!("{url}/kv/t/null-headers")).send().await?.status(), 200);

    let as_array = http.post(format!("{url}/topics")).body(r#"["u", 1, 1, {}]"#).send().await?;
    let (status, code, message) = error_of(as_array).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_json"), "a create whose body is an array");
    assert!(message.contains("JSON object"), "{message}");
    assert_eq!(http.get(format!("{url}/topics/u")).send().await?.status(), 404, "no topic from an array");

    // A field a body does not know is refused by name, not dropped: a misspelt `partitions`
    // would otherwise create a topic of one partition.
    for (path, body, field) in [
        ("topics", json!({"name": "u", "partitons": 3}), "partitons"),
        ("topics/t/config", json!({"configs": {"retention.ms": "1000"}}), "configs"),
        ("topics/t/partitions/0/replicas", json!({"replicas": [1], "force": true}), "force"),
        ("topics/t/records", json!({"records": [], "encodng": "utf8"}), "encodng"),
        ("topics/t/records", json!({"records": [{"key": "u", "valu": "v"}]}), "valu"),
    ] {
        let method = if path.ends_with("replicas") { reqwest::Method::PUT } else { reqwest::Method::POST };
        let (status, code, message) =
            error_of(http.request(method, format!("{url}/{path}")).json(&body).send().await?).await?;
        assert_eq!((status, code.as_str()), (400, "invalid_json"), "{path} with {field}: {message}");
        assert!(message.contains(&format!("unknown field `{field}`")), "{path}: {message}");
    }
    assert_eq!(http.get(format!("{url}/topics/u")).send().await?.status(), 404, "no topic from a misspelt field");
    assert_eq!(http.get(format!("{url}/kv/t/u")).send().await?.status(), 404, "no record from a misspelt field");

    let wrong_method = http.post(format!("{url}/kv/t/k")).body("v").send().await?;
    let allow = wrong_method.headers().get("allow").and_then(|v| v.to_str().ok()).map(str::to_string);
    let (status, code, message) = error_of(wrong_method).await?;
    assert_eq!((status, code.as_str()), (405, "method_not_allowed"));
    let allow = allow.ok_or("405 without an Allow header")?;
    assert!(allow.contains("PUT") && message.contains("Allow header"), "message {message:?}, Allow {allow:?}");
    let (status, code, message) = error_of(http.get(format!("{url}/no/such/route")).send().await?).await?;
    assert_eq!((status, code.as_str()), (404, "route_not_found"));
    assert!(!message.is_empty(), "a 404 says what it is");
    let made_up = reqwest::Method::from_bytes(b"BREW")?;
    assert_eq!(http.request(made_up, format!("{url}/no/such/pot")).send().await?.status(), 404);
    let metrics = http.get(format!("{url}/metrics")).send().await?.text().await?;
    for method in ["GET", "OTHER"] {
        let series = format!(
            "logdex_http_request_duration_seconds_count{{origin=\"http\",method=\"{method}\",route=\"unmatched\",status=\"404\"}} 1"
        );
        assert!(metrics.lines().any(|l| l == series), "{series} in {metrics}");
    }

    let spelled_out = json!({"name": "t", "partitions": 2, "replication_factor": 1,
        "config": {"cleanup.policy": "compact", "kv.index.enabled": "true"}});
    let again = http.post(format!("{url}/topics")).json(&spelled_out).send().await?;
    assert_eq!(again.status(), 200, "a create spelling out the defaults is the existing topic");
    node.shutdown().await;
    Ok(())
}

/// A name no topic can have (not UTF-8, empty, over 249 bytes, a character Kafka refuses) is
/// 400 `invalid_topic` on every route that names a topic, as `POST /topics` answers it, where
/// a valid name of no topic is 404 `topic_not_found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_names_that_break_kafkas_rules_answer_400_invalid_topic_on_every_route() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    let long = "x".repeat(300);
    for name in ["%FF", "%20", "bad%21name", "a,b", long.as_str()] {
        let requests = [
            http.get(format!("{url}/kv/{name}/k")),
            http.put(format!("{url}/kv/{name}/k")).body("v"),
            http.delete(format!("{url}/kv/{name}/k")),
            http.get(format!("{url}/topics/{name}")),
            http.delete(format!("{url}/topics/{name}")),
            http.post(format!("{url}/topics/{name}/config")).json(&json!({"config": {"retention.ms": "1000"}})),
            http.post(format!("{url}/topics/{name}/records")).json(&json!({"records": [{"key": "k", "value": "v"}]})),
            http.get(format!("{url}/topics/{name}/partitions/0/records?offset=0")),
            http.put(format!("{url}/topics/{name}/partitions/0/replicas")).json(&json!({"replicas": [1]})),
        ];
        for request in requests {
            let request = request.build()?;
            let what = format!("{} {}", request.method(), request.url().path());
            let (status, code, message) = error_of(http.execute(request).await?).await?;
            assert_eq!((status, code.as_str()), (400, "invalid_topic"), "{what}: {message}");
        }
    }
    let (status, code, _) = error_of(http.get(format!("{url}/kv/no-such-topic/k")).send().await?).await?;
    assert_eq!((status, code.as_str()), (404, "topic_not_found"), "a valid name of no topic");
    let (status, code, _) = error_of(http.get(format!("{url}/topics/no-such-topic")).send().await?).await?;
    assert_eq!((status, code.as_str()), (404, "topic_not_found"));
    let fetch = http.get(format!("{url}/topics/no-such-topic/partitions/%FF/records")).send().await?;
    let (status, code, _) = error_of(fetch).await?;
    assert_eq!((status, code.as_str()), (400, "invalid_partition"), "a partition that is not UTF-8");
    node.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_request_limit_answers_413_naming_the_limit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "t", 1).await?;
    // Over the 8 MiB request body limit (a value's own bound is checked after the body is read).
    let body = vec![b'x'; 8 * 1024 * 1024 + 1];
    let (status, code, message) = error_of(http.put(format!("{url}/kv/t/k")).body(body).send().await?).await?;
    assert_eq!((status, code.as_str()), (413, "too_large"), "{message}");
    assert!(message.contains(&(8 * 1024 * 1024).to_string()), "the answer names the limit: {message}");
    node.shutdown().await;
    Ok(())
}
