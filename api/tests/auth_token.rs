//! `--auth-token-file`: every HTTP request but the health, readiness and metrics endpoints,
//! and every client gRPC call (the no-work `Noop` too), needs `Authorization: Bearer <token>`; without it, or with
//! another token, 401 `unauthorized` (gRPC: UNAUTHENTICATED).

mod common;

use common::TestResult;
use common::start_node;
use logdex_api::grpc::pb;
use logdex_api::grpc::pb::logdex_client::LogdexClient;

const TOKEN: &str = "s3cret-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_bearer_token_answer_401_over_http_and_grpc() -> TestResult {
    let dir = tempfile::tempdir()?;
    let token_arg = common::token_file(dir.path(), "token", TOKEN)?;
    let data_dir = dir.path().join("data");
    let (node, url) = start_node(&data_dir, &["--auth-token-file", &token_arg]).await?;
    let http = reqwest::Client::new();
    let bearer = format!("Bearer {TOKEN}");

    let topic = r#"{"name":"t","partitions":1,"replication_factor":1}"#;
    let anonymous = http.post(format!("{url}/topics")).body(topic).send().await?;
    assert_eq!(anonymous.status(), 401);
    let body: serde_json::Value = anonymous.json().await?;
    assert_eq!(body["error"]["code"], "unauthorized", "{body}");
    let created = http.post(format!("{url}/topics")).header("authorization", &bearer).body(topic).send().await?;
    assert_eq!(created.status(), 201);
    let put = http.put(format!("{url}/kv/t/k")).header("authorization", &bearer).body("v").send().await?;
    assert_eq!(put.status(), 200);

    let lower_case_scheme = format!("bearer {TOKEN}");
    for (authorization, status) in [
        (None, 401),
        (Some("Bearer wrong"), 401),
        (Some(TOKEN), 401),
        (Some(&*bearer), 200),
        (Some(&*lower_case_scheme), 200),
    ] {
        let mut get = http.get(format!("{url}/kv/t/k"));
        if let Some(a) = authorization {
            get = get.header("authorization", a);
        }
        assert_eq!(get.send().await?.status(), status, "lookup with authorization {authorization:?}");
    }
    for open in ["healthz", "readyz", "metrics"] {
        assert_eq!(http.get(format!("{url}/{open}")).send().await?.status(), 200, "/{open} without a token");
    }

    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let get = || pb::GetRequest { topic: "t".into(), key: b"k".to_vec(), read: 0, ..Default::default() };
    let refused = client.get(get()).await.err().ok_or("a gRPC Get without a token answered")?;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().starts_with("unauthorized"), "{}", refused.message());
    let put = pb::PutRequest { topic: "t".into(), key: b"k".to_vec(), value: b"w".to_vec(), ..Default::default() };
    let refused = client.put(put.clone()).await.err().ok_or("a gRPC Put without a token answered")?;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");

    let mut with_token = tonic::Request::new(put);
    with_token.metadata_mut().insert("authorization", bearer.parse()?);
    client.put(with_token).await?;
    let mut with_token = tonic::Request::new(get());
    with_token.metadata_mut().insert("authorization", bearer.parse()?);
    let got = client.get(with_token).await?.into_inner();
    assert!(got.found);
    assert_eq!(got.value, b"w");

    // Without the token, input that would be refused is refused for the token first, as over
    // HTTP: nothing about topics or limits is told to a caller without it.
    let bad_mode = pb::GetRequest { read: 9, ..get() };
    let long_key = pb::PutRequest { topic: "nope".into(), key: vec![b'k'; 20_000], ..Default::default() };
    let bad_fetch = pb::FetchRequest { topic: "nope".into(), read: 9, ..Default::default() };
    let refusals = [
        ("Get with an undefined read mode", client.get(bad_mode).await.err()),
        ("Put of a key over the limit", client.put(long_key).await.err()),
        ("Fetch with an undefined read mode", client.fetch(bad_fetch).await.err()),
    ];
    for (what, refused) in refusals {
        let refused = refused.ok_or(format!("{what} without a token answered"))?;
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{what}: {refused:?}");
    }
    let refused = client.noop(pb::NoopRequest {}).await.err().ok_or("a gRPC Noop without a token answered")?;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let mut with_token = tonic::Request::new(pb::NoopRequest {});
    with_token.metadata_mut().insert("authorization", bearer.parse()?);
    assert_eq!(client.noop(with_token).await?.into_inner().body, [b'x'; 100], "the floor's fixed body");
    let metrics = http.get(format!("{url}/metrics")).send().await?.text().await?;
    for status in [200, 401] {
        let series = format!("origin=\"grpc\",method=\"GET\",route=\"/bench/noop\",status=\"{status}\"");
        assert!(metrics.lines().any(|l| l.contains(&series)), "Noop counted with {status}: {metrics}");
    }
    node.shutdown().await;
    Ok(())
}
