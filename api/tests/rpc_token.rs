//! `--rpc-token-file`: node-to-node RPC needs `Authorization: Bearer <token>`. Nodes given the
//! same token join, replicate and serve each other's reads; an RPC without it, or with another
//! token, is UNAUTHENTICATED. The client gRPC API on the same port does not take this token.

mod common;

use common::TestResult;
use common::start_node;
use logdex_api::grpc::pb as client_pb;
use logdex_api::grpc::pb::logdex_client::LogdexClient;
use logdex_raft::pb;
use logdex_raft::pb::raft_service_client::RaftServiceClient;

const TOKEN: &str = "node-to-node-secret";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_to_node_rpc_needs_the_token_and_nodes_sharing_it_replicate() -> TestResult {
    let dir = tempfile::tempdir()?;
    let token_arg = common::token_file(dir.path(), "rpc-token", TOKEN)?;
    let (node_1, url_1) =
        start_node(&dir.path().join("n1"), &["--node-id", "1", "--rpc-token-file", &token_arg]).await?;
    let join = node_1.rpc_addr.to_string();
    let (node_2, url_2) =
        start_node(&dir.path().join("n2"), &["--node-id", "2", "--join", &join, "--rpc-token-file", &token_arg])
            .await?;

    // Replication and read indexes between the two nodes go over the RPC with the token.
    let http = reqwest::Client::new();
    let topic = r#"{"name":"t","partitions":2,"replication_factor":2}"#;
    assert_eq!(http.post(format!("{url_1}/topics")).body(topic).send().await?.status(), 201);
    let put = http.put(format!("{url_1}/kv/t/k")).body("v").send().await?;
    assert_eq!(put.status(), 200);
    for read in ["linearizable", "strict"] {
        let got = http.get(format!("{url_2}/kv/t/k?read={read}")).send().await?;
        assert_eq!(got.status(), 200, "{read} read on node 2");
        assert_eq!(got.text().await?, "v");
    }

    let endpoint = format!("http://{}", node_1.rpc_addr);
    let mut raft = RaftServiceClient::connect(endpoint.clone()).await?;
    for authorization in [None, Some("Bearer wrong-token"), Some(TOKEN)] {
        let mut request = tonic::Request::new(pb::StatusRequest {});
        if let Some(a) = authorization {
            request.metadata_mut().insert("authorization", a.parse()?);
        }
        let refused = raft.status(request).await.err().ok_or("a node-to-node RPC without the token answered")?;
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "authorization {authorization:?}: {refused:?}");
    }
    let mut request = tonic::Request::new(pb::StatusRequest {});
    request.metadata_mut().insert("authorization", format!("Bearer {TOKEN}").parse()?);
    let status = raft.status(request).await?.into_inner();
    assert_eq!(status.node_id, 1);

    // The client API on the same port is not behind the node-to-node token.
    let mut client = LogdexClient::connect(endpoint).await?;
    let get = client_pb::GetRequest { topic: "t".into(), key: b"k".to_vec(), read: 0, ..Default::default() };
    let got = client.get(get).await?.into_inner();
    assert!(got.found);
    assert_eq!(got.value, b"v");
    drop((raft, client));
    node_2.shutdown().await;
    node_1.shutdown().await;
    Ok(())
}
