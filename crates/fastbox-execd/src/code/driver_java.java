// fastbox-execd java code-context driver (embedded in execd; written to a file and run with
// `java FILE`, the single-file source launcher of JDK 11 and later). One JShell per context:
// declarations, imports and variables stay for the next runs, as in `jshell`. The value of
// the last expression is the result. Reads one JSON request per line from stdin:
// {"code": str, "sentinel": str}; after each execution writes `<sentinel> <json>` to stdout
// and `<sentinel>` to stderr. SIGINT stops a running execution.
import java.io.BufferedReader;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.stream.Collectors;

import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;

public class FastboxJavaDriver {
    /** Set by SIGINT: the execution running was stopped. */
    static volatile boolean interrupted;

    public static void main(String[] args) throws Exception {
        PrintStream out = new PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.out), true, StandardCharsets.UTF_8);
        PrintStream err = new PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.err), true, StandardCharsets.UTF_8);
        BufferedReader requests = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        // The source file execd wrote for this process goes at once.
        if (args.length > 0) {
            java.io.File source = new java.io.File(args[0]);
            source.delete();
            source.getParentFile().delete();
        }
        // Snippets run in this JVM: their output is this process's, in order with the
        // sentinels.
        JShell shell = JShell.builder()
                .executionEngine("local")
                .out(out)
                .err(err)
                .in(InputStream.nullInputStream())
                .build();
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> {
            interrupted = true;
            shell.stop();
        });
        int count = 0;
        for (String line; (line = requests.readLine()) != null; ) {
            String code = field(line, "code");
            String sentinel = field(line, "sentinel");
            if (code == null || sentinel == null) {
                continue;
            }
            count += 1;
            interrupted = false;
            String trailer = run(shell, code, count);
            if (interrupted) {
                trailer = error(count, "InterruptedException", "execution interrupted", List.of());
            }
            System.out.flush();
            System.err.flush();
            out.flush();
            err.flush();
            out.print(sentinel + " " + trailer + "\n");
            out.flush();
            err.print(sentinel + "\n");
            err.flush();
        }
        shell.close();
    }

    /** Runs every snippet of `code`; the trailer's JSON. */
    static String run(JShell shell, String code, int count) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String remaining = code;
        String result = null;
        while (!remaining.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(remaining);
            String source = info.source();
            if (source == null || source.isBlank()) {
                if (info.completeness() == SourceCodeAnalysis.Completeness.DEFINITELY_INCOMPLETE
                        || info.completeness() == SourceCodeAnalysis.Completeness.CONSIDERED_INCOMPLETE) {
                    return error(count, "CompilationError", "incomplete input: " + remaining.strip(), List.of());
                }
                source = remaining;
                remaining = "";
            } else {
                remaining = info.remaining();
            }
            result = null;
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) {
                    continue;
                }
                if (event.status() == Snippet.Status.REJECTED) {
                    List<String> lines = new ArrayList<>();
                    String message = shell.diagnostics(event.snippet())
                            .map(d -> d.getMessage(null))
                            .collect(Collectors.joining("\n"));
                    lines.add(message);
                    return error(count, "CompilationError", message, lines);
                }
                JShellException thrown = event.exception();
                if (thrown != null) {
                    String name = thrown instanceof EvalException
                            ? ((EvalException) thrown).getExceptionClassName()
                            : thrown.getClass().getName();
                    List<String> trace = new ArrayList<>();
                    trace.add(name + ": " + (thrown.getMessage() == null ? "" : thrown.getMessage()));
                    for (StackTraceElement frame : thrown.getStackTrace()) {
                        trace.add("\tat " + frame);
                    }
                    String message = thrown.getMessage() == null ? "" : thrown.getMessage();
                    return error(count, name, message, trace);
                }
                if (event.value() != null && event.snippet().kind() == Snippet.Kind.EXPRESSION
                        || event.value() != null && event.snippet().kind() == Snippet.Kind.VAR
                        && event.snippet().subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND) {
                    result = event.value();
                }
            }
        }
        StringBuilder trailer = new StringBuilder("{\"execution_count\":").append(count);
        if (result != null) {
            trailer.append(",\"result\":").append(quote(result));
        }
        return trailer.append("}").toString();
    }

    static String error(int count, String name, String message, List<String> trace) {
        String lines = trace.stream().map(FastboxJavaDriver::quote).collect(Collectors.joining(","));
        return "{\"execution_count\":" + count + ",\"error\":{\"ename\":" + quote(name)
                + ",\"evalue\":" + quote(message) + ",\"traceback\":[" + lines + "]}}";
    }

    static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        return b.append('"').toString();
    }

    /** The string value of `key` in the flat JSON object `json` (null when absent). */
    static String field(String json, String key) {
        String marker = "\"" + key + "\":";
        int at = json.indexOf(marker);
        while (at >= 0) {
            int i = at + marker.length();
            while (i < json.length() && json.charAt(i) == ' ') {
                i++;
            }
            if (i < json.length() && json.charAt(i) == '"') {
                return unquote(json, i + 1);
            }
            at = json.indexOf(marker, at + 1);
        }
        return null;
    }

    static String unquote(String json, int from) {
        StringBuilder b = new StringBuilder();
        for (int i = from; i < json.length(); i++) {
            char c = json.charAt(i);
            if (c == '"') {
                return b.toString();
            }
            if (c != '\\') {
                b.append(c);
                continue;
            }
            char e = json.charAt(++i);
            switch (e) {
                case 'n': b.append('\n'); break;
                case 't': b.append('\t'); break;
                case 'r': b.append('\r'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u':
                    b.append((char) Integer.parseInt(json.substring(i + 1, i + 5), 16));
                    i += 4;
                    break;
                default: b.append(e);
            }
        }
        return null;
    }
}
