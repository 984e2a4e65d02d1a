package io.txnlake.storage;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;

import io.delta.storage.S3SingleDriverLogStore;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.s3a.RemoteFileChangedException;

/**
 * Delta's S3 log store, made safe for writers on several hosts: a new log entry is created with
 * S3's conditional PUT (If-None-Match: *), so of two writers of version N exactly one succeeds and
 * the other gets FileAlreadyExistsException, which Delta answers by checking for conflicts and
 * retrying at N+1. delta-rs creates its entries the same way, so both commit to one table safely.
 * (S3SingleDriverLogStore excludes writers inside one JVM only; Delta's DynamoDB log store needs a
 * DynamoDB table.) Overwrites (_last_checkpoint) stay plain PUTs.
 */
public class S3ConditionalLogStore extends S3SingleDriverLogStore {

    public S3ConditionalLogStore(Configuration hadoopConf) {
        super(hadoopConf);
    }

    @Override
    public void write(Path path, Iterator<String> actions, Boolean overwrite, Configuration hadoopConf)
            throws IOException {
        if (overwrite) {
            super.write(path, actions, true, hadoopConf);
            return;
        }
        FileSystem fs = path.getFileSystem(hadoopConf);
        Path resolved = fs.makeQualified(path);
        try {
            // S3A checks the condition when the stream closes: that is where a lost race shows.
            FSDataOutputStream out = (FSDataOutputStream) fs.createFile(resolved).overwrite(false).recursive()
                .must("fs.option.create.conditional.overwrite", true).build();
            try {
                while (actions.hasNext()) {
                    out.write((actions.next() + "\n").getBytes(StandardCharsets.UTF_8));
                }
            } finally {
                out.close();
            }
        } catch (org.apache.hadoop.fs.FileAlreadyExistsException | RemoteFileChangedException e) {
            // 412 Precondition Failed on If-None-Match: another writer created this version first.
            throw new java.nio.file.FileAlreadyExistsException(resolved.toString());
        }
    }
}
