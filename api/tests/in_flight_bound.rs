//! `--requests-in-flight-max N`: a node serves at most N requests at once; one more answers
//! 503 `unavailable` (with `Retry-After`) at once, over HTTP and over gRPC, and the node
//! serves again when the requests in flight are done; `/healthz` and `/metrics` answer all the
//! while.

mod common;

use std::time::Duration;
use std::time::Instant;

use common::TestResult;
use common::start_node;
use logdex_api::grpc::pb;
use logdex_api::grpc::pb::logdex_client::LogdexClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beyond_the_in_flight_bound_answers_503_until_one_finishes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = start_node(dir.path(), &["--requests-in-flight-max", "2"]).await?;
    let http = reqwest::Client::new();
    let topic = r#"{"name":"t","partitions":1,"replication_factor":1}"#;
    assert_eq!(http.post(format!("{url}/topics")).body(topic).send().await?.status(), 201);
    assert_eq!(http.put(format!("{url}/kv/t/k")).body("v").send().await?.status(), 200);

    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let get = || pb::GetRequest { topic: "t".into(), key: b"k".to_vec(), read: 0, ..Default::default() };
    let mut checked = false;
    for attempt in 1..=3 {
        // Two lookups that wait (bounded, about 1 s) for an offset the partition never
        // reaches hold both places.
        let started = Instant::now();
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move {
                    http.get(format!("{url}/kv/t/k?read=follower&min_offset=1000000")).send().await.map(|r| r.status())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(250)).await;
        let got = http.get(format!("{url}/kv/t/k")).send().await?;
        if got.status() == 200 {
            // The waiting lookups were not both in yet (a slow machine): again.
            eprintln!("attempt {attempt}: a lookup still found a place");
            for w in waiting {
                w.await??;
            }
            continue;
        }
        assert_eq!(got.status(), 503);
        assert!(got.headers().contains_key("retry-after"));
        let body: serde_json::Value = got.json().await?;
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
        assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("in flight")), "{body}");
        // Health and metrics still answer: a busy node is not a dead one.
        for open in ["healthz", "metrics"] {
            assert_eq!(http.get(format!("{url}/{open}")).send().await?.status(), 200, "/{open} on a busy node");
        }
        let grpc = client.get(get()).await;
        // The waiting lookups give up after about 1 s; a Get answered later proves nothing.
        let too_late = started.elapsed() >= Duration::from_millis(900);
        for w in waiting {
            assert_eq!(w.await??, 503, "the waiting lookup gives up on the offset");
        }
        match grpc {
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                checked = true;
                break;
            }
            // The waiting lookups gave up before the gRPC Get came (a slow machine): again.
            Ok(_) if too_late => eprintln!("attempt {attempt}: the places were free again before the gRPC Get"),
            Ok(_) => return Err("a gRPC Get beyond the bound answered".into()),
        }
    }
    assert!(checked, "no lookup met the bound in 3 attempts");
    assert_eq!(http.get(format!("{url}/kv/t/k")).send().await?.status(), 200);
    assert!(client.get(get()).await?.into_inner().found);
    node.shutdown().await;
    Ok(())
}
