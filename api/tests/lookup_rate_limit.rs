//! `--lookup-rate-limit`: lookups beyond the per-client rate answer 429 (`rate_limited`,
//! `Retry-After`), other requests are not limited, and the client's budget refills; gRPC
//! `Get`s draw on the same budget (RESOURCE_EXHAUSTED).

mod common;

use std::time::Duration;

use common::TestResult;
use common::start_node;
use logdex_api::grpc::pb;
use logdex_api::grpc::pb::logdex_client::LogdexClient;

const RATE: u32 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_beyond_the_per_client_rate_answer_429_and_writes_are_not_limited() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &["--lookup-rate-limit", &RATE.to_string()]).await?;
    let http = reqwest::Client::new();
    let created = http
        .post(format!("{url}/topics"))
        .json(&serde_json::json!({"name": "limited", "partitions": 1, "replication_factor": 1}))
        .send()
        .await?;
    assert_eq!(created.status(), 201);
    // Writes are not lookups: twice the rate of them all succeed.
    for i in 0..2 * RATE {
        let put = http.put(format!("{url}/kv/limited/k{i}")).body("v").send().await?;
        assert_eq!(put.status(), 200, "put {i}");
    }

    let mut statuses = Vec::new();
    let mut refused = None;
    for i in 0..4 * RATE {
        let got = http.get(format!("{url}/kv/limited/k{}", i % RATE)).send().await?;
        statuses.push(got.status().as_u16());
        if got.status() == 429 && refused.is_none() {
            let retry_after = got.headers().get("retry-after").map(|v| v.to_str().map(str::to_string));
            let body: serde_json::Value = got.json().await?;
            refused = Some((retry_after, body));
        }
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    assert!(ok >= RATE as usize, "the bucket starts full: {statuses:?}");
    assert!(ok < statuses.len(), "lookups past the rate are refused: {statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
    let (retry_after, body) = refused.ok_or("no 429")?;
    assert!(retry_after.is_some(), "a 429 carries Retry-After");
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");

    // A second later the bucket has refilled.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = http.get(format!("{url}/kv/limited/k0")).send().await?;
    assert_eq!(again.status(), 200);

    // A HEAD is a lookup (its headers say whether the key exists, and where): the same budget.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut heads = Vec::new();
    for i in 0..4 * RATE {
        heads.push(http.head(format!("{url}/kv/limited/k{}", i % RATE)).send().await?.status().as_u16());
    }
    let ok = heads.iter().filter(|s| **s == 200).count();
    assert!(ok >= RATE as usize && ok < heads.len(), "HEAD lookups past the rate are refused: {heads:?}");
    assert!(heads.iter().all(|s| *s == 200 || *s == 429), "{heads:?}");

    // gRPC `Get`s draw on the same per-client budget: RESOURCE_EXHAUSTED past it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let mut codes = Vec::new();
    for i in 0..4 * RATE {
        let request = pb::GetRequest {
            topic: "limited".into(),
            key: format!("k{}", i % RATE).into_bytes(),
            read: 0,
            ..Default::default()
        };
        codes.push(match client.get(request).await {
            Ok(got) if got.get_ref().found => tonic::Code::Ok,
            Ok(_) => return Err("a written key was not found over gRPC".into()),
            Err(status) => {
                assert!(status.message().starts_with("rate_limited"), "{}", status.message());
                status.code()
            }
        });
    }
    let ok = codes.iter().filter(|c| **c == tonic::Code::Ok).count();
    assert!(ok >= RATE as usize, "the bucket starts full: {codes:?}");
    assert!(ok < codes.len(), "gRPC lookups past the rate are refused: {codes:?}");
    assert!(codes.iter().all(|c| matches!(c, tonic::Code::Ok | tonic::Code::ResourceExhausted)), "{codes:?}");
    node.shutdown().await;
    Ok(())
}
