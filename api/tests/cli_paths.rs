//! The CLI's key paths reach the key they name, also for keys a URL client would resolve
//! as dot segments (`.` and `..`).

mod common;

use common::TestResult;
use common::start_node;
use logdex_api::client::kv_path;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_keys_written_and_read_through_cli_paths_are_their_own_keys() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "t", 1).await?;
    for (key, value) in [(".", "one dot"), ("..", "two dots"), ("a/../b", "slashes")] {
        let put = http.put(format!("{url}{}", kv_path("t", key.as_bytes(), ""))).body(value).send().await?;
        assert_eq!(put.status(), 200, "put {key:?}: {}", put.text().await?);
    }
    for (key, value) in [(".", "one dot"), ("..", "two dots"), ("a/../b", "slashes")] {
        let got = http.get(format!("{url}{}", kv_path("t", key.as_bytes(), "read=follower"))).send().await?;
        assert_eq!(got.status(), 200, "get {key:?}");
        assert_eq!(got.text().await?, value, "get {key:?}");
    }
    // The same keys, spelled base64url by hand, are the ones the CLI wrote.
    let by_hand = http.get(format!("{url}/kv/t/Lg?key_encoding=base64url")).send().await?;
    assert_eq!(by_hand.text().await?, "one dot");
    node.shutdown().await;
    Ok(())
}
