//! The client gRPC API against an in-process single-node server: the same
//! answers as the HTTP API, including binary keys, tombstones and fetch.

mod common;

use common::TestResult;
use logdex_api::grpc::pb;
use logdex_api::grpc::pb::logdex_client::LogdexClient;
use logdex_api::serve::RunningNode;

async fn single_node(dir: &std::path::Path) -> TestResult<RunningNode> {
    let (node, url) = common::start_node(dir, &[]).await?;
    let created = reqwest::Client::new()
        .post(format!("{url}/topics"))
        .body(r#"{"name":"t","partitions":2,"replication_factor":1}"#)
        .send()
        .await?;
    assert!(created.status().is_success(), "create topic: {}", created.status());
    Ok(node)
}

/// Put, get (found and not found), delete and get again over gRPC, with a binary key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_put_get_delete_round_trip_with_binary_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = single_node(dir.path()).await?;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let key = vec![0u8, 0xff, b'/', b'%', 7];
    let put = client
        .put(pb::PutRequest { topic: "t".into(), key: key.clone(), value: b"v1".to_vec(), partition: None })
        .await?
        .into_inner();
    let got = client
        .get(pb::GetRequest { topic: "t".into(), key: key.clone(), read: 0, partition: None, min_offset: None })
        .await?
        .into_inner();
    assert!(got.found);
    assert_eq!(got.value, b"v1");
    assert_eq!((got.partition, got.offset), (put.partition, put.offset));
    assert!(got.high_watermark > got.offset);
    client.delete(pb::DeleteRequest { topic: "t".into(), key: key.clone(), partition: None }).await?;
    let gone = client
        .get(pb::GetRequest { topic: "t".into(), key, read: 2, partition: None, min_offset: None })
        .await?
        .into_inner();
    assert!(!gone.found);
    assert_eq!(gone.partition, put.partition);
    let unknown = client
        .get(pb::GetRequest { topic: "nope".into(), key: b"k".to_vec(), read: 0, partition: None, min_offset: None })
        .await;
    let status = unknown.err().ok_or("unknown topic answered")?;
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert!(status.message().starts_with("topic_not_found"), "{}", status.message());
    node.shutdown().await;
    Ok(())
}

/// Produce a batch with headers and a tombstone over gRPC, then fetch it back in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_produce_then_fetch_returns_records_in_order() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = single_node(dir.path()).await?;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let records = vec![
        pb::Record {
            key: Some(b"a".to_vec()),
            value: Some(vec![1, 2, 3]),
            headers: [("h".to_string(), b"x".to_vec())].into(),
            partition: Some(1),
        },
        pb::Record { key: Some(b"a".to_vec()), value: None, headers: Default::default(), partition: Some(1) },
    ];
    let produced = client.produce(pb::ProduceRequest { topic: "t".into(), records }).await?.into_inner();
    assert_eq!(produced.offsets.len(), 2);
    assert_eq!(produced.offsets[1].offset, produced.offsets[0].offset + 1);
    let fetched = client
        .fetch(pb::FetchRequest { topic: "t".into(), partition: 1, offset: 0, max_records: 10, max_bytes: 0, read: 0 })
        .await?
        .into_inner();
    assert_eq!(fetched.records.len(), 2);
    assert_eq!(fetched.records[0].value.as_deref(), Some(&[1u8, 2, 3][..]));
    assert_eq!(fetched.records[0].headers.get("h").map(Vec::as_slice), Some(&b"x"[..]));
    assert_eq!(fetched.records[1].value, None);
    assert_eq!(fetched.next_offset, 2);
    assert_eq!(fetched.high_watermark, 2);
    node.shutdown().await;
    Ok(())
}
