//! A fetch page spells keys and values as UTF-8 text when it can and as base64 otherwise,
//! unless the client asks for one spelling with `?encoding=base64` or `?encoding=utf8`.

mod common;

use common::TestResult;
use common::start_node;
use serde_json::Value;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_spells_records_the_way_the_client_asks() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "t", 1).await?;
    // Offset 0 is text; offset 1 has a value that is not UTF-8 (0xff 0xfe, base64 "//4=").
    let text = json!({"records": [{"key": "k1", "value": "v1"}]});
    assert_eq!(http.post(format!("{url}/topics/t/records")).json(&text).send().await?.status(), 200);
    // Produce names its encoding in the body, or with fetch's `?encoding=` (not both, unless they agree).
    let binary = json!({"records": [{"key": "azI=", "value": "//4="}]});
    let produced = http.post(format!("{url}/topics/t/records?encoding=base64")).json(&binary).send().await?;
    assert_eq!(produced.status(), 200);
    let conflicting = json!({"encoding": "utf8", "records": [{"key": "k3", "value": "v3"}]});
    let refused = http.post(format!("{url}/topics/t/records?encoding=base64")).json(&conflicting).send().await?;
    assert_eq!(refused.status(), 400, "body and query disagree");

    let fetch = |query: &'static str| {
        let http = http.clone();
        let url = url.clone();
        async move {
            TestResult::Ok(http.get(format!("{url}/topics/t/partitions/0/records?offset=0&{query}")).send().await?)
        }
    };
    let page: Value = fetch("max_records=1").await?.json().await?;
    assert_eq!((&page["encoding"], &page["records"][0]["key"]), (&json!("utf8"), &json!("k1")), "{page}");
    let page: Value = fetch("max_records=1&encoding=base64").await?.json().await?;
    assert_eq!((&page["encoding"], &page["records"][0]["key"]), (&json!("base64"), &json!("azE=")), "{page}");
    let page: Value = fetch("encoding=auto").await?.json().await?;
    assert_eq!(page["encoding"], "base64", "a page with binary bytes falls back to base64: {page}");
    assert_eq!(page["records"][1]["value"], "//4=");

    let page: Value = fetch("max_records=1&encoding=utf8").await?.json().await?;
    assert_eq!(page["encoding"], "utf8", "a text page asked for as utf8: {page}");
    for query in ["encoding=utf8", "encoding=latin1"] {
        let refused = fetch(query).await?;
        assert_eq!(refused.status(), 400, "{query}");
        let body: Value = refused.json().await?;
        assert_eq!(body["error"]["code"], "invalid_encoding", "{query}: {body}");
        if query == "encoding=utf8" {
            let message = body["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("offset 1"), "the refusal names the record: {message}");
        }
    }
    node.shutdown().await;
    Ok(())
}
