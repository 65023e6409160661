//! A typed, blocking client of the lifecycle API (`/v1/sandboxes...`), with the wire types of
//! `fastbox_api::lifecycle`. It is an ordinary client: the API key goes in
//! `OPEN-SANDBOX-API-KEY`, and nothing here knows how the server is built.

use reqwest::Method;
use reqwest::Url;
use reqwest::blocking::{Client, RequestBuilder};
use serde::Serialize;

use fastbox_api::lifecycle::{
    CreateSandboxResponse, DiagnosticContentResponse, Endpoint, ImageSpec, ListSandboxesResponse,
    PaginationInfo, Sandbox, StringMap,
};

use super::http::{self, HttpError};

/// The header carrying the API key.
pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";

/// Largest `pageSize` the API accepts.
pub const MAX_PAGE_SIZE: u32 = 200;

/// `POST /v1/sandboxes`, as this CLI sends it. `timeout` is always sent: `null` asks for no
/// automatic expiry, as the SDK does.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateRequest {
    pub image: ImageSpec,
    pub entrypoint: Vec<String>,
    pub timeout: Option<u64>,
    pub resource_limits: StringMap,
    #[serde(skip_serializing_if = "StringMap::is_empty")]
    pub env: StringMap,
    #[serde(skip_serializing_if = "StringMap::is_empty")]
    pub metadata: StringMap,
}

/// `GET /v1/sandboxes` filters and the page wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    /// Any of these states (none: all).
    pub states: Vec<String>,
    /// Every one of these metadata pairs.
    pub metadata: Vec<(String, String)>,
    pub page: u32,
    pub page_size: u32,
}

impl ListQuery {
    /// The query string: repeated `state`, one `metadata=k=v&k2=v2` whose keys and values are
    /// encoded once more (the server decodes the parameter, then parses it as a query).
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs: Vec<(&'static str, String)> =
            self.states.iter().map(|s| ("state", s.clone())).collect();
        if !self.metadata.is_empty() {
            let filter = form_urlencoded::Serializer::new(String::new())
                .extend_pairs(&self.metadata)
                .finish();
            pairs.push(("metadata", filter));
        }
        pairs.push(("page", self.page.to_string()));
        pairs.push(("pageSize", self.page_size.to_string()));
        pairs
    }
}

/// Which diagnostics to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Diagnostics {
    /// The entrypoint's output (`logs?scope=container`).
    Logs,
    /// The sandbox's lifecycle events (`events?scope=runtime`).
    Events,
}

impl Diagnostics {
    fn path_and_scope(self) -> (&'static str, &'static str) {
        match self {
            Self::Logs => ("logs", "container"),
            Self::Events => ("events", "runtime"),
        }
    }
}

pub struct ApiClient {
    /// The server's URL, e.g. `http://127.0.0.1:8080`; `/v1/...` is appended.
    base: Url,
    api_key: Option<String>,
    http: Client,
}

impl ApiClient {
    pub fn try_new(base: Url, api_key: Option<String>) -> Result<Self, HttpError> {
        Ok(Self {
            base,
            api_key,
            http: http::client(Some(std::time::Duration::from_secs(60)))?,
        })
    }

    /// `http` or `https`: execd endpoints are reached with the same scheme as the API.
    pub fn scheme(&self) -> &str {
        self.base.scheme()
    }

    /// `{base}/v1/{segments...}`, each segment percent-encoded.
    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .expect("an http(s) URL has a path")
            .pop_if_empty()
            .push("v1")
            .extend(segments);
        url
    }

    fn request(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        let request = self.http.request(method, self.url(segments));
        match &self.api_key {
            Some(key) => request.header(API_KEY_HEADER, key),
            None => request,
        }
    }

    pub fn create(&self, body: &CreateRequest) -> Result<CreateSandboxResponse, HttpError> {
        http::send_json(
            self.request(Method::POST, &["sandboxes"]).json(body),
            "create the sandbox",
        )
    }

    pub fn list(&self, query: &ListQuery) -> Result<ListSandboxesResponse, HttpError> {
        http::send_json(
            self.request(Method::GET, &["sandboxes"])
                .query(&query.pairs()),
            "list sandboxes",
        )
    }

    /// Every page of `query` (its `page` and `page_size` are ignored) as one response.
    pub fn list_all(&self, query: &ListQuery) -> Result<ListSandboxesResponse, HttpError> {
        let mut page_query = ListQuery {
            page: 1,
            page_size: MAX_PAGE_SIZE,
            ..query.clone()
        };
        let mut all = self.list(&page_query)?;
        while all.pagination.has_next_page {
            page_query.page += 1;
            let next = self.list(&page_query)?;
            all.items.extend(next.items);
            all.pagination.has_next_page = next.pagination.has_next_page;
        }
        // One page holding every item.
        let count = all.items.len();
        all.pagination = PaginationInfo::of(1, count.max(1) as u32, count).0;
        Ok(all)
    }

    pub fn get(&self, id: &str) -> Result<Sandbox, HttpError> {
        http::send_json(
            self.request(Method::GET, &["sandboxes", id]),
            "get the sandbox",
        )
    }

    /// `DELETE /v1/sandboxes/{id}`: the sandbox is `Stopping`, then `Terminated`.
    pub fn delete(&self, id: &str) -> Result<(), HttpError> {
        http::send(
            self.request(Method::DELETE, &["sandboxes", id]),
            "delete the sandbox",
        )
        .map(drop)
    }

    /// Where a sandbox port is reached (a direct node-proxy route, never the server proxy).
    pub fn endpoint(&self, id: &str, port: u16) -> Result<Endpoint, HttpError> {
        http::send_json(
            self.request(
                Method::GET,
                &["sandboxes", id, "endpoints", &port.to_string()],
            )
            .query(&[("use_server_proxy", "false")]),
            "resolve the sandbox endpoint",
        )
    }

    pub fn diagnostics(
        &self,
        id: &str,
        which: Diagnostics,
    ) -> Result<DiagnosticContentResponse, HttpError> {
        let (kind, scope) = which.path_and_scope();
        http::send_json(
            self.request(Method::GET, &["sandboxes", id, "diagnostics", kind])
                .query(&[("scope", scope)]),
            "get the sandbox diagnostics",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(base: &str) -> ApiClient {
        ApiClient::try_new(Url::parse(base).unwrap(), None).unwrap()
    }

    #[test]
    fn urls_append_v1_and_encode_segments() {
        let api = client("http://127.0.0.1:8080");
        assert_eq!(
            api.url(&["sandboxes", "a b/c"]).as_str(),
            "http://127.0.0.1:8080/v1/sandboxes/a%20b%2Fc"
        );
        let behind_a_path = client("https://example.org/fastbox/");
        assert_eq!(
            behind_a_path.url(&["sandboxes"]).as_str(),
            "https://example.org/fastbox/v1/sandboxes"
        );
    }

    #[test]
    fn list_queries_encode_metadata_as_one_parameter() {
        let query = ListQuery {
            states: vec!["Running".into(), "Pending".into()],
            metadata: vec![("a".into(), "b c".into()), ("x".into(), "y&z".into())],
            page: 2,
            page_size: 5,
        };
        let url = Url::parse_with_params("http://h/v1/sandboxes", query.pairs()).unwrap();
        assert_eq!(
            url.query(),
            Some("state=Running&state=Pending&metadata=a%3Db%2Bc%26x%3Dy%2526z&page=2&pageSize=5")
        );
    }

    #[test]
    fn create_sends_null_timeout_and_omits_empty_maps() {
        let body = CreateRequest {
            image: ImageSpec {
                uri: "fastbox/busybox".into(),
                auth: None,
            },
            entrypoint: vec!["tail".into(), "-f".into(), "/dev/null".into()],
            timeout: None,
            resource_limits: StringMap::new(),
            env: StringMap::new(),
            metadata: StringMap::from([("k".into(), "v".into())]),
        };
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"image":{"uri":"fastbox/busybox"},"entrypoint":["tail","-f","/dev/null"],"timeout":null,"resourceLimits":{},"metadata":{"k":"v"}}"#
        );
    }
}
