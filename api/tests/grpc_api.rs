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
        .put(pb::PutRequest { topic: "t".into(), key: key.clone(), value: b"v1".to_vec(), ..Default::default() })
        .await?
        .into_inner();
    let got = client
        .get(pb::GetRequest { topic: "t".into(), key: key.clone(), read: 0, ..Default::default() })
        .await?
        .into_inner();
    assert!(got.found);
    assert_eq!(got.value, b"v1");
    assert_eq!((got.partition, got.offset), (put.partition, put.offset));
    assert!(got.high_watermark > got.offset);
    client.delete(pb::DeleteRequest { topic: "t".into(), key: key.clone(), ..Default::default() }).await?;
    let gone = client.get(pb::GetRequest { topic: "t".into(), key, read: 2, ..Default::default() }).await?.into_inner();
    assert!(!gone.found);
    assert_eq!(gone.partition, put.partition);
    let unknown =
        client.get(pb::GetRequest { topic: "nope".into(), key: b"k".to_vec(), read: 0, ..Default::default() }).await;
    let status = unknown.err().ok_or("unknown topic answered")?;
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert!(status.message().starts_with("topic_not_found"), "{}", status.message());
    node.shutdown().await;
    Ok(())
}

/// Produce a batch with headers (one of them null) and a tombstone over gRPC, then fetch it
/// back in order, as HTTP fetches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_produce_then_fetch_returns_records_in_order() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = single_node(dir.path()).await?;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let records = vec![
        pb::Record {
            key: Some(b"a".to_vec()),
            value: Some(vec![1, 2, 3]),
            headers: [("h".to_string(), b"x".to_vec()), ("e".to_string(), Vec::new())].into(),
            partition: Some(1),
            null_headers: vec!["n".to_string()],
        },
        pb::Record { key: Some(b"a".to_vec()), value: None, partition: Some(1), ..Default::default() },
    ];
    let both = pb::Record { headers: [("n".to_string(), Vec::new())].into(), ..records[0].clone() };
    let refused = client
        .produce(pb::ProduceRequest { topic: "t".into(), records: vec![both], ..Default::default() })
        .await
        .err()
        .ok_or("a header both null and not was taken")?;
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("invalid_record: record 0: header \"n\""), "{refused:?}");
    let produced =
        client.produce(pb::ProduceRequest { topic: "t".into(), records, ..Default::default() }).await?.into_inner();
    assert_eq!(produced.offsets.len(), 2);
    assert_eq!(produced.offsets[1].offset, produced.offsets[0].offset + 1);
    let fetched = client
        .fetch(pb::FetchRequest { topic: "t".into(), partition: 1, max_records: 10, ..Default::default() })
        .await?
        .into_inner();
    assert_eq!(fetched.records.len(), 2);
    assert_eq!(fetched.records[0].value.as_deref(), Some(&[1u8, 2, 3][..]));
    assert_eq!(fetched.records[0].headers.get("h").map(Vec::as_slice), Some(&b"x"[..]));
    assert_eq!(fetched.records[0].headers.get("e").map(Vec::as_slice), Some(&b""[..]), "empty, not null");
    assert_eq!(fetched.records[0].null_headers, ["n"]);
    assert!(!fetched.records[0].headers.contains_key("n"));
    let url = format!("http://{}/topics/t/partitions/1/records?offset=0", node.http_addr);
    let http: serde_json::Value = reqwest::get(&url).await?.json().await?;
    assert_eq!(http["records"][0]["headers"], serde_json::json!({"h": "x", "e": "", "n": null}), "{http}");
    assert_eq!(fetched.records[1].value, None);
    assert_eq!(fetched.next_offset, 2);
    assert_eq!(fetched.high_watermark, 2);
    node.shutdown().await;
    Ok(())
}

/// Bad input gets the answer HTTP gives, and a topic name that breaks Kafka's rules reaches no
/// other topic, key, partition or route: `invalid_topic`, before anything is written or read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_bad_topic_names_read_modes_and_sizes_are_refused_and_touch_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = single_node(dir.path()).await?;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let put = |topic: &str, key: &[u8], value: Vec<u8>| pb::PutRequest {
        topic: topic.into(),
        key: key.to_vec(),
        value,
        ..Default::default()
    };
    client.put(put("t", b"bob", b"kept".to_vec())).await?;
    let expect =
        |result: Result<tonic::Response<pb::WriteResponse>, tonic::Status>, code: tonic::Code, prefix: &str| {
            let status = result.err().ok_or("a bad request succeeded")?;
            assert_eq!(status.code(), code, "{status:?}");
            assert!(status.message().starts_with(prefix), "{status:?}");
            TestResult::Ok(())
        };
    for topic in ["t/bob?", "t/forced?partition=1&", "t#frag", "bad name!", "a/b"] {
        let invalid = tonic::Code::InvalidArgument;
        expect(client.put(put(topic, b"zzz", b"injected".to_vec())).await, invalid, "invalid_topic")?;
        let deleted =
            client.delete(pb::DeleteRequest { topic: topic.into(), key: b"zzz".to_vec(), ..Default::default() });
        expect(deleted.await, invalid, "invalid_topic")?;
        let fetched =
            client.fetch(pb::FetchRequest { topic: topic.into(), max_records: 1, ..Default::default() }).await;
        assert_eq!(fetched.err().map(|s| s.code()), Some(invalid), "fetch of topic {topic:?}");
        let produced = client.produce(pb::ProduceRequest { topic: topic.into(), ..Default::default() }).await;
        assert_eq!(produced.err().map(|s| s.code()), Some(invalid), "produce to topic {topic:?}");
    }
    let bob = client.get(get_request("t", b"bob")).await?.into_inner();
    assert_eq!((bob.found, bob.value.as_slice()), (true, &b"kept"[..]), "a bad topic name reached key bob");
    for key in [&b"zzz"[..], b"injected", b"forced"] {
        assert!(!client.get(get_request("t", key)).await?.into_inner().found, "key {key:?} was written");
    }

    for read in [3, 99, -1] {
        let got = client.get(pb::GetRequest { read, ..get_request("t", b"bob") }).await;
        let status = got.err().ok_or("an unknown read mode was served")?;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with("invalid_read_mode"), "{status:?}");
        let fetched =
            client.fetch(pb::FetchRequest { topic: "t".into(), max_records: 1, read, ..Default::default() }).await;
        assert_eq!(fetched.err().map(|s| s.code()), Some(tonic::Code::InvalidArgument), "fetch with read {read}");
    }

    // A key far over its bound (and over a URI's) and a value over the body limit: too_large.
    expect(client.put(put("t", &vec![b'k'; 60_000], b"v".to_vec())).await, tonic::Code::InvalidArgument, "too_large")?;
    expect(client.put(put("t", b"big", vec![7; 10 << 20])).await, tonic::Code::InvalidArgument, "too_large")?;

    // A topic name far over any topic's: bad input, in a message short enough for the status
    // header (over 16 KiB a client refuses the header and the call fails instead).
    let long = "x".repeat(20_000);
    let status = client.get(get_request(&long, b"k")).await.err().ok_or("a 20,000-byte topic was found")?;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("invalid_topic") && status.message().len() <= 1100, "{status:?}");
    expect(client.put(put(&long, b"k", b"v".to_vec())).await, tonic::Code::InvalidArgument, "invalid_topic")?;

    // A request that does not decode (a topic that is not UTF-8): bad input, not a server fault.
    let mut raw = tonic::client::Grpc::new(
        tonic::transport::Channel::from_shared(format!("http://{}", node.rpc_addr))?.connect().await?,
    );
    raw.ready().await?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/logdex.api.v1.Logdex/Get");
    let codec = tonic_prost::ProstCodec::<RawGetRequest, pb::GetResponse>::default();
    let undecodable = raw.unary(tonic::Request::new(RawGetRequest { topic: vec![0xff, 0xfe] }), path, codec).await;
    let status = undecodable.err().ok_or("a request that is not a GetRequest was served")?;
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("invalid_request"), "{status:?}");
    node.shutdown().await;
    Ok(())
}

/// `GetRequest` with its topic (field 1, a string there) as any bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawGetRequest {
    #[prost(bytes = "vec", tag = "1")]
    topic: Vec<u8>,
}

fn get_request(topic: &str, key: &[u8]) -> pb::GetRequest {
    pb::GetRequest { topic: topic.into(), key: key.to_vec(), read: 0, ..Default::default() }
}

fn header_u64(response: &reqwest::Response, name: &str) -> TestResult<u64> {
    let value = response.headers().get(name).ok_or_else(|| format!("no {name} header"))?;
    Ok(value.to_str()?.parse()?)
}

/// The count of the request series of `origin` (`http` or `grpc`), `method`, key route and
/// `status` in `/metrics`.
async fn key_requests_counted(url: &str, origin: &str, method: &str, status: u16) -> TestResult<u64> {
    let text = reqwest::get(format!("{url}/metrics")).await?.text().await?;
    let series = format!(
        "logdex_http_request_duration_seconds_count{{origin=\"{origin}\",method=\"{method}\",route=\"/kv/{{topic}}/{{*key}}\",status=\"{status}\"}} "
    );
    Ok(text.lines().find_map(|l| l.strip_prefix(&series)).map_or(Ok(0), str::parse)?)
}

/// Lookups answered with `status`, over HTTP and over gRPC.
async fn lookups_counted(url: &str, status: u16) -> TestResult<(u64, u64)> {
    Ok((
        key_requests_counted(url, "http", "GET", status).await?,
        key_requests_counted(url, "grpc", "GET", status).await?,
    ))
}

/// A gRPC `Put` and `Delete` answer what `PUT` and `DELETE /kv/{topic}/{key}` answer: the
/// partition and offset of the record, which a lookup then finds (or, after the delete, does
/// not); the same error codes for bad input; and they are counted in the key route's request
/// metrics under their HTTP methods, as gRPC calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_put_and_delete_answer_what_http_writes_answer() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    common::create_topic(&http, &url, "t", 3).await?;
    let counted = || async {
        TestResult::Ok([
            key_requests_counted(&url, "grpc", "PUT", 200).await?,
            key_requests_counted(&url, "http", "PUT", 200).await?,
            key_requests_counted(&url, "grpc", "DELETE", 200).await?,
            key_requests_counted(&url, "grpc", "PUT", 400).await?,
        ])
    };
    let counted_before = counted().await?;
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;
    let put = |key: &[u8], value: &[u8]| pb::PutRequest {
        topic: "t".into(),
        key: key.to_vec(),
        value: value.to_vec(),
        ..Default::default()
    };
    let written = client.put(put(b"alice", b"hello")).await?.into_inner();
    let looked_up = http.get(format!("{url}/kv/t/alice")).send().await?;
    assert_eq!(looked_up.status(), 200);
    assert_eq!(written.partition as u64, header_u64(&looked_up, "x-kv-partition")?);
    assert_eq!(written.offset, header_u64(&looked_up, "x-kv-offset")?);
    assert_eq!(looked_up.bytes().await?.as_ref(), b"hello");
    // The key's partition is Kafka's, as over HTTP.
    let over_http = http.put(format!("{url}/kv/t/alice")).body("again").send().await?;
    assert_eq!(header_u64(&over_http, "x-kv-partition")?, written.partition as u64);
    assert_eq!(header_u64(&over_http, "x-kv-offset")?, written.offset + 1);

    let deleted = client.delete(pb::DeleteRequest { topic: "t".into(), key: b"alice".to_vec(), ..Default::default() });
    let deleted = deleted.await?.into_inner();
    assert_eq!((deleted.partition, deleted.offset), (written.partition, written.offset + 2));
    assert_eq!(http.get(format!("{url}/kv/t/alice")).send().await?.status(), 404);

    let refused = [
        (put(b"", b"v"), tonic::Code::InvalidArgument, "invalid_key"),
        (pb::PutRequest { partition: Some(3), ..put(b"bob", b"v") }, tonic::Code::InvalidArgument, "invalid_partition"),
        (pb::PutRequest { topic: "nope".into(), ..put(b"bob", b"v") }, tonic::Code::NotFound, "topic_not_found"),
    ];
    for (request, code, error_code) in refused {
        let status = client.put(request).await.err().ok_or("bad input answered")?;
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().starts_with(error_code), "{}", status.message());
    }

    // Two puts (one over HTTP), one delete, and the three refused puts (two with 400, the
    // third with 404).
    let counted_after = counted().await?;
    let added: Vec<u64> = counted_after.iter().zip(counted_before).map(|(after, before)| after - before).collect();
    assert_eq!(added, [1, 1, 1, 2], "gRPC puts, HTTP puts, gRPC deletes, gRPC puts refused with 400");
    node.shutdown().await;
    Ok(())
}

/// A gRPC `Get` answers what `GET /kv/{topic}/{key}` answers: value, partition, offset, high
/// watermark, node and timestamp of a found key; partition, high watermark and node of a
/// missing one; the same error codes for bad input; and it is counted in the lookup route's
/// request metrics as a gRPC call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_get_answers_what_the_http_lookup_answers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (node, url) = common::start_node(dir.path(), &[]).await?;
    let http = reqwest::Client::new();
    let created = http.post(format!("{url}/topics")).body(r#"{"name":"t","partitions":3,"replication_factor":1}"#);
    assert!(created.send().await?.status().is_success());
    let put = http.put(format!("{url}/kv/t/alice")).body("hello").send().await?;
    assert_eq!(put.status(), 200);
    let counted_before = (lookups_counted(&url, 200).await?, lookups_counted(&url, 404).await?);
    let mut client = LogdexClient::connect(format!("http://{}", node.rpc_addr)).await?;

    let over_http = http.get(format!("{url}/kv/t/alice")).send().await?;
    assert_eq!(over_http.status(), 200);
    let got = client.get(get_request("t", b"alice")).await?.into_inner();
    assert!(got.found);
    assert_eq!(got.partition as u64, header_u64(&over_http, "x-kv-partition")?);
    assert_eq!(got.offset, header_u64(&over_http, "x-kv-offset")?);
    assert_eq!(got.high_watermark, header_u64(&over_http, "x-kv-high-watermark")?);
    assert_eq!(got.node, header_u64(&over_http, "x-kv-node")?);
    assert_eq!(got.timestamp_ms as u64, header_u64(&over_http, "x-kv-timestamp")?);
    assert_eq!(got.value, over_http.bytes().await?.to_vec());
    assert_eq!(got.value, b"hello");

    let missing_http = http.get(format!("{url}/kv/t/nobody")).send().await?;
    assert_eq!(missing_http.status(), 404);
    let missing = client.get(get_request("t", b"nobody")).await?.into_inner();
    assert!(!missing.found);
    assert!(missing.value.is_empty());
    assert_eq!(missing.partition as u64, header_u64(&missing_http, "x-kv-partition")?);
    assert_eq!(missing.high_watermark, header_u64(&missing_http, "x-kv-high-watermark")?);
    assert_eq!(missing.node, header_u64(&missing_http, "x-kv-node")?);

    let refused = [
        (get_request("t", b""), tonic::Code::InvalidArgument, "invalid_key"),
        (get_request("t", &vec![b'k'; 16 * 1024 + 1]), tonic::Code::InvalidArgument, "too_large"),
        (
            pb::GetRequest { partition: Some(3), ..get_request("t", b"alice") },
            tonic::Code::InvalidArgument,
            "invalid_partition",
        ),
    ];
    for (request, code, error_code) in refused {
        let status = client.get(request).await.err().ok_or("bad input answered")?;
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().starts_with(error_code), "{}", status.message());
    }

    // One found and one missing lookup over HTTP, the same over gRPC.
    let counted_after = (lookups_counted(&url, 200).await?, lookups_counted(&url, 404).await?);
    let (found, missing) = (counted_before.0, counted_before.1);
    assert_eq!(counted_after, ((found.0 + 1, found.1 + 1), (missing.0 + 1, missing.1 + 1)));
    node.shutdown().await;
    Ok(())
}

/// A gRPC `Get` on a node without a replica of the key's partition goes where the HTTP
/// lookup goes: forwarded to a node that has one, or, with `--forward=false`,
/// FAILED_PRECONDITION (`misdirected`) with that node's URL in the `x-kv-redirect` metadata.
/// Two nodes, node 2 started with `--forward=false`, and topic `t` of 4 partitions with one
/// replica each; key `one` written to a partition on node 1, `two` to one on node 2.
struct TwoNodes {
    node_1: RunningNode,
    node_2: RunningNode,
    url_1: String,
    on_1: u32,
    on_2: u32,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn two_nodes_one_replica_each() -> TestResult<TwoNodes> {
    let (dir_1, dir_2) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (node_1, url_1) = common::start_node(dir_1.path(), &["--node-id", "1"]).await?;
    let join = node_1.rpc_addr.to_string();
    let (node_2, _url_2) =
        common::start_node(dir_2.path(), &["--node-id", "2", "--join", &join, "--forward=false"]).await?;
    let http = reqwest::Client::new();
    let created = http.post(format!("{url_1}/topics")).body(r#"{"name":"t","partitions":4,"replication_factor":1}"#);
    assert!(created.send().await?.status().is_success());
    let described: serde_json::Value = http.get(format!("{url_1}/topics/t")).send().await?.json().await?;
    let host_of = |node: u64| {
        described["partitions"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["replicas"][0] == node))
            .and_then(|p| p["partition"].as_u64())
            .map(|p| p as u32)
            .ok_or_else(|| format!("no partition on node {node}: {described}"))
    };
    let (on_1, on_2) = (host_of(1)?, host_of(2)?);
    for (partition, key) in [(on_1, "one"), (on_2, "two")] {
        let put = http.put(format!("{url_1}/kv/t/{key}?partition={partition}")).body(key).send().await?;
        assert_eq!(put.status(), 200, "put {key}");
    }
    Ok(TwoNodes { node_1, node_2, url_1, on_1, on_2, _dirs: (dir_1, dir_2) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_get_of_a_partition_hosted_elsewhere_is_forwarded_or_redirected() -> TestResult {
    let TwoNodes { node_1, node_2, url_1, on_1, on_2, _dirs } = two_nodes_one_replica_each().await?;

    let mut client_1 = LogdexClient::connect(format!("http://{}", node_1.rpc_addr)).await?;
    let request = pb::GetRequest { partition: Some(on_2), ..get_request("t", b"two") };
    let forwarded = client_1.get(request).await?.into_inner();
    assert!(forwarded.found);
    assert_eq!((forwarded.value.as_slice(), forwarded.partition, forwarded.node), (&b"two"[..], on_2, 2));

    let mut client_2 = LogdexClient::connect(format!("http://{}", node_2.rpc_addr)).await?;
    let request = pb::GetRequest { partition: Some(on_1), ..get_request("t", b"one") };
    let status = client_2.get(request).await.err().ok_or("node 2 answered for a partition it does not hold")?;
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().starts_with("misdirected"), "{}", status.message());
    let redirect = status.metadata().get("x-kv-redirect").ok_or("no x-kv-redirect")?.to_str()?.to_string();
    assert!(redirect.starts_with(&url_1), "{redirect} is not on node 1 ({url_1})");
    let rpc = status.metadata().get("x-kv-redirect-rpc").ok_or("no x-kv-redirect-rpc")?.to_str()?;
    assert_eq!(rpc, node_1.rpc_addr.to_string(), "x-kv-redirect-rpc of a Get that node 1 serves");
    // A write through the router gets the same pair.
    let put = pb::PutRequest {
        topic: "t".into(),
        key: b"one".to_vec(),
        value: b"x".to_vec(),
        partition: Some(on_1),
        forward: None,
    };
    let refused = client_2.put(put).await.err().ok_or("node 2 took a write for a partition it does not hold")?;
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    let rpc = refused.metadata().get("x-kv-redirect-rpc").ok_or("no x-kv-redirect-rpc on a put")?.to_str()?;
    assert_eq!(rpc, node_1.rpc_addr.to_string(), "x-kv-redirect-rpc of a Put that node 1 takes");
    let here = client_2.get(pb::GetRequest { partition: Some(on_2), ..get_request("t", b"two") }).await?;
    assert_eq!(here.get_ref().node, 2);
    drop((client_1, client_2));
    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}

/// A request's own `forward` overrides the node's `--forward`, as HTTP's `?forward=` does:
/// false on a forwarding node answers FAILED_PRECONDITION with both redirects, true on a
/// node started with `--forward=false` is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_request_forward_field_overrides_the_node_flag() -> TestResult {
    let TwoNodes { node_1, node_2, on_1, on_2, .. } = two_nodes_one_replica_each().await?;
    let mut client_1 = LogdexClient::connect(format!("http://{}", node_1.rpc_addr)).await?;
    let mut client_2 = LogdexClient::connect(format!("http://{}", node_2.rpc_addr)).await?;
    let misdirected_to_node_2 = |status: tonic::Status, what: &str| -> TestResult {
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{what}: {status:?}");
        assert!(status.message().starts_with("misdirected"), "{what}: {}", status.message());
        let rpc = status.metadata().get("x-kv-redirect-rpc").ok_or("no x-kv-redirect-rpc")?.to_str()?;
        assert_eq!(rpc, node_2.rpc_addr.to_string(), "{what}");
        assert!(status.metadata().get("x-kv-redirect").is_some(), "{what}: no x-kv-redirect");
        Ok(())
    };

    // Node 1 forwards by default; forward = false refuses what node 2 holds.
    let get = pb::GetRequest { partition: Some(on_2), forward: Some(false), ..get_request("t", b"two") };
    misdirected_to_node_2(client_1.get(get).await.err().ok_or("Get forward=false was forwarded")?, "Get")?;
    let put = pb::PutRequest {
        topic: "t".into(),
        key: b"two".to_vec(),
        value: b"refused".to_vec(),
        partition: Some(on_2),
        forward: Some(false),
    };
    misdirected_to_node_2(client_1.put(put).await.err().ok_or("Put forward=false was forwarded")?, "Put")?;
    let delete =
        pb::DeleteRequest { topic: "t".into(), key: b"two".to_vec(), partition: Some(on_2), forward: Some(false) };
    misdirected_to_node_2(client_1.delete(delete).await.err().ok_or("Delete forward=false was forwarded")?, "Delete")?;
    let fetch = pb::FetchRequest { topic: "t".into(), partition: on_2, forward: Some(false), ..Default::default() };
    misdirected_to_node_2(client_1.fetch(fetch).await.err().ok_or("Fetch forward=false was forwarded")?, "Fetch")?;
    let record = pb::Record {
        key: Some(b"two".to_vec()),
        value: Some(b"refused".to_vec()),
        partition: Some(on_2),
        ..Default::default()
    };
    let produce = pb::ProduceRequest { topic: "t".into(), records: vec![record], forward: Some(false) };
    misdirected_to_node_2(
        client_1.produce(produce).await.err().ok_or("Produce forward=false was forwarded")?,
        "Produce",
    )?;
    let got = client_2.get(pb::GetRequest { partition: Some(on_2), ..get_request("t", b"two") }).await?.into_inner();
    assert_eq!(got.value, b"two", "the refused writes wrote nothing");

    // Node 2 does not forward by default; forward = true takes a request to node 1.
    let get = pb::GetRequest { partition: Some(on_1), forward: Some(true), ..get_request("t", b"one") };
    let got = client_2.get(get).await?.into_inner();
    assert_eq!((got.found, got.value.as_slice(), got.node), (true, &b"one"[..], 1));
    let put = pb::PutRequest {
        topic: "t".into(),
        key: b"one".to_vec(),
        value: b"via 2".to_vec(),
        partition: Some(on_1),
        forward: Some(true),
    };
    let written = client_2.put(put).await?.into_inner();
    assert_eq!((written.partition, written.offset), (on_1, 1));
    let fetch = pb::FetchRequest { topic: "t".into(), partition: on_1, forward: Some(true), ..Default::default() };
    let fetched = client_2.fetch(fetch).await?.into_inner();
    let values: Vec<_> = fetched.records.iter().map(|r| r.value.clone().unwrap_or_default()).collect();
    assert_eq!(values, [b"one".to_vec(), b"via 2".to_vec()]);
    let get = pb::GetRequest { partition: Some(on_1), ..get_request("t", b"one") };
    let refused = client_2.get(get).await.err().ok_or("node 2 forwarded without being asked")?;
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "absent forward follows --forward=false");
    drop((client_1, client_2));
    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}
